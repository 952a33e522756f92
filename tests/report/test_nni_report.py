"""Under ``nnictl stop`` the manager can go before a trial's report reaches it: the trial says so in one line and
goes on to its signal's checkpoint, never a traceback from NNI's REST client."""

import nni
import pytest
import requests

from parnas.strategies.nni_trial import report_to_nni


@pytest.mark.parametrize("final", [False, True])
def test_a_report_to_a_manager_that_has_gone_is_one_line(monkeypatch, capsys, final):
    def gone(metric):
        raise requests.exceptions.ConnectionError("HTTPConnectionPool(host='localhost', port=8080): refused")

    monkeypatch.setattr(nni, "report_final_result" if final else "report_intermediate_result", gone)
    report_to_nni({"default": 50.0}, final=final)  # does not raise
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "NNI's manager did not take the" in err and "Traceback" not in err


def test_a_report_the_manager_takes_is_sent_as_given(monkeypatch, capsys):
    sent = []
    monkeypatch.setattr(nni, "report_intermediate_result", sent.append)
    report_to_nni({"default": 50.0, "architecture": "AD"})
    assert sent == [{"default": 50.0, "architecture": "AD"}] and capsys.readouterr().err == ""
