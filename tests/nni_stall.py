"""NNI 3.0's multi-trial loop stalls now and then: its tuner channel receives a command cut short
(``JSONDecodeError: Unterminated string`` in the search's ``log/experiment.log``), after which the manager
starts no more trials, and parnas's watch ends the search ("... the search stops there"). It was seen in
full-suite runs on the 2-core machine, in one run in four of those, never in a test run alone (12 of 12 runs of
the four multi-trial tests passed), with websockets 13.1 as with 17.4; its cause inside NNI is not found.
A test that runs NNI's multi-trial loop fails on a stall with ``STALLED`` first in its message, and is run again
on that failure alone, twice at most: any other failure fails at once, and three stalls in a row fail."""

import pytest

STALLED = "NNI's multi-trial loop stalled: "
rerun_on_stall = pytest.mark.flaky(reruns=2, only_rerun=[STALLED])
