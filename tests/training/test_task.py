"""The training task: learning-rate schedule, evaluation maths."""

import math

import pytest
import torch

from parnas.config import ModelConfig, load_config
from parnas.nn.model import build_fixed_model
from parnas.training.evaluation import evaluate
from parnas.training.task import lr_multiplier


def test_warmup_is_linear_then_cosine_reaches_the_floor_at_max_steps():
    warmup, total = 10, 110
    ramp = [lr_multiplier(s, warmup, total) for s in range(warmup)]
    assert ramp == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert lr_multiplier(warmup, warmup, total) == pytest.approx(1.0)
    assert lr_multiplier(warmup + 50, warmup, total) == pytest.approx(0.5)
    assert lr_multiplier(total, warmup, total, min_ratio=0.1) == pytest.approx(0.1)
    decay = [lr_multiplier(s, warmup, total) for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lr_multiplier(total + 5, warmup, total) == pytest.approx(0.0)  # stays at the floor


def test_evaluate_is_exp_of_total_nll_and_deterministic_with_dropout_configured():
    torch.manual_seed(0)
    cfg = ModelConfig(n_blocks=2, d_model=16, n_heads=2, d_ff=32, mem_len=4, dropout=0.3, cutoffs=())
    model = build_fixed_model(cfg, 50).train()
    stream = torch.randint(0, 50, (2, 25))
    batches = [(stream[:, t:t + 8], stream[:, t + 1:t + 9]) for t in (0, 8)] + [(stream[:, 16:24], stream[:, 17:25])]
    first, second = evaluate(model, batches), evaluate(model, batches)
    assert model.training  # restored
    assert first.nll == second.nll and first.tokens == 48
    model.eval()
    mems, total = None, 0.0
    with torch.no_grad():
        for x, y in batches:
            h, mems = model(x, mems)
            total += model.nll(h, y).sum().item()
    assert first.ppl == pytest.approx(math.exp(total / 48), rel=1e-6)


class _Stop(Exception):
    pass


def test_evaluation_sends_batches_to_the_device_the_weights_are_on():
    """Lightning moves a module back to the CPU when fit ends, while the trainer still names the GPU:
    evaluation must follow the weights, not a device named elsewhere. A model on the meta device shows
    it without a GPU (batches on any other device would reach its first block)."""
    from parnas.training.data_module import SegmentData
    from parnas.training.evaluation import split_metrics

    cfg = ModelConfig(n_blocks=2, d_model=16, n_heads=2, d_ff=32, mem_len=4, cutoffs=())
    model = build_fixed_model(cfg, 50).to("meta")
    seen = []

    def record(module, args):
        seen.append((args[0].device, next(module.parameters()).device))
        raise _Stop

    model.register_forward_pre_hook(record)
    stream = torch.randint(0, 50, (200,)).numpy()
    data = SegmentData({"valid": stream}, batch_size=2, eval_batch_size=2, seg_len=8)
    for run in (lambda: evaluate(model, data.batches("valid")), lambda: split_metrics(model, data, "valid")):
        seen.clear()
        with pytest.raises(_Stop):
            run()
        assert seen == [(torch.device("meta"), torch.device("meta"))]


def test_a_fraction_of_a_split_reads_the_first_part_of_every_stream_and_says_so():
    """The final pick's early rounds judge on part of the validation split: the same perplexity as a whole
    pass over those tokens, fewer tokens read, and the metrics say which part it was."""
    from parnas.training.data_module import SegmentData
    from parnas.training.evaluation import split_metrics

    torch.manual_seed(0)
    model = build_fixed_model(ModelConfig(n_blocks=2, d_model=16, n_heads=2, d_ff=32, mem_len=4, cutoffs=()), 50)
    stream = torch.randint(0, 50, (2 * 8 * 20 + 1,)).numpy()  # 2 streams of 20 segments of 8
    data = SegmentData({"valid": stream}, batch_size=2, eval_batch_size=2, seg_len=8)
    whole, quarter = split_metrics(model, data, "valid"), split_metrics(model, data, "valid", fraction=0.25)
    assert "val_fraction" not in whole and quarter["val_fraction"] == 0.25
    assert quarter["val_tokens"] == 2 * 8 * 5 and whole["val_tokens"] == 2 * 8 * 20 - 2  # the streams' last target
    assert quarter["val_tokens"] + quarter["val_untargeted_tokens"] == whole["val_tokens"] + \
        whole["val_untargeted_tokens"] == len(stream)  # what is not read is counted as not targeted
    batches = data.batches("valid")
    first = evaluate(model, (batches[t] for t in range(5)))
    assert quarter["val_ppl"] == pytest.approx(first.ppl, rel=1e-6) != pytest.approx(whole["val_ppl"], rel=1e-6)


def test_a_non_finite_loss_is_named_by_its_first_step_when_it_is_read(monkeypatch):
    """The finite-loss check stays on the device between reads; when read it names the first bad step, not the
    step it was read at."""
    from parnas.config import load_config
    from parnas.errors import ParnasError
    from parnas.training.task import LanguageModelTask

    task = LanguageModelTask(load_config("tiny").train)
    monkeypatch.setattr(LanguageModelTask, "global_step", property(lambda self: self._step))
    for task._step, value in enumerate([1.0, 2.0, float("nan"), float("inf"), 1.0]):
        task._note_nonfinite(torch.tensor([[0.5, value]]))
        if task._step == 1:
            task.check_finite()  # nothing bad yet: no error
    with pytest.raises(ParnasError, match="diverged at step 3 .*not finite"):
        task.check_finite()


def test_a_step_reseeded_draws_what_torch_manual_seed_draws():
    """Dropout is reseeded every step by ``reseed``, which leaves out the seed queues ``torch.manual_seed`` fills
    for accelerators the process never started: the numbers drawn stay those of ``torch.manual_seed``, so runs
    and checkpoints resumed across versions draw as before."""
    from parnas.training.task import reseed

    torch.manual_seed(1234)
    expected = torch.nn.functional.dropout(torch.ones(64), 0.5), torch.rand(5)
    torch.manual_seed(0)
    reseed(1234, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(expected, (torch.nn.functional.dropout(torch.ones(64), 0.5),
                                                             torch.rand(5))))
    reseed(1234, torch.device("meta"))  # a model built on the meta device (the placement tests) is reseeded too


def test_a_step_on_a_gpu_reseeds_that_gpus_generator(monkeypatch):
    """A DDP rank's step on ``cuda:1`` draws its dropout from that GPU's generator, so that is the one reseeded
    (and the CPU's); shown with stand-in generators, without a GPU."""
    from parnas.training.task import reseed

    generators = (torch.Generator(), torch.Generator())
    for generator in generators:
        generator.manual_seed(7)
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    reseed(1234, torch.device("cuda", 1))
    assert [g.initial_seed() for g in generators] == [7, 1234] and torch.initial_seed() == 1234


def test_the_scalars_of_a_step_are_logged_when_something_reads_them():
    """Lightning writes logged scalars every ``log_every_n_steps`` steps and the progress lines print after the
    first step, every ``train.log_every`` and at the last: those steps log, the others (whose ``self.log`` calls
    cost a tenth of a small model's step) do not."""
    from types import SimpleNamespace

    from parnas.training.task import scalars_read

    def logged(log_every_n_steps: int, progress_every: int, max_steps: int) -> list[int]:
        return [step for step in range(1, max_steps + 1) if scalars_read(SimpleNamespace(
            global_step=step - 1, log_every_n_steps=log_every_n_steps, max_steps=max_steps), progress_every)]

    assert logged(5, 10, 23) == [1, 5, 10, 15, 20, 23]
    assert logged(10, 4, 12) == [1, 4, 8, 10, 12]


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_compiled_models_capacities_hold_every_segment_before_its_first_training_batch(world_size):
    """The data module fits a compiled model's target capacities to every segment of the training and validation
    splits, on every rank, before it groups the first training batch: no batch grows them afterwards (which would
    compile the loss again), every rank pads alike, and a resumed run, fitted afresh, pads as the first did.
    Validation batches are grouped as they come (their loss is eager)."""
    from types import SimpleNamespace

    from parnas.nn.adaptive import TargetCapacity, group_targets
    from parnas.training.data_module import SegmentData, most_targets_per_cluster
    from parnas.training.latency import zipf_ids
    from parnas.training.task import LanguageModelTask

    cfg = ModelConfig(n_blocks=2, d_model=16, n_heads=2, d_ff=32, cutoffs=(10, 40))
    splits = {"train": zipf_ids(4 * 7 * 8 + 9, 100).numpy(), "valid": zipf_ids(2 * 5 * 8 + 7, 100).numpy()}
    fitted = []
    for _ in range(2):  # the first run and a resumed one
        model = build_fixed_model(cfg, 100)
        model.target_capacity = TargetCapacity()  # what compile_model gives it
        task = LanguageModelTask(load_config("tiny").train)
        task.set_model(model)
        data = SegmentData(splits, 4, 2, 8)
        data.trainer = SimpleNamespace(lightning_module=task, strategy=SimpleNamespace(root_device=torch.device("cpu")),
                                       training=True, world_size=world_size)
        for rank in range(world_size):
            for t, (x, y) in enumerate(data.batches("train", rank, world_size)):
                groups = data.on_before_batch_transfer((x, y), 0)[2]
                if t == 0 and rank == 0:
                    fitted.append(dict(model.target_capacity.by_rows))
                assert groups.valid is not None and groups.sizes[1:] == fitted[-1][y.numel()]
                assert int(groups.valid.sum()) == sum(group_targets(y, cfg.cutoffs).sizes[1:])
        assert model.target_capacity.by_rows == fitted[-1]  # held every batch: grown by none
        data.trainer.training = False
        x, y = next(iter(data.batches("valid", 0, world_size)))
        assert data.on_before_batch_transfer((x, y), 0)[2].valid is None
    assert fitted[0] == fitted[1] and len(fitted[0]) == 3  # training's rows, validation's, its last segment's
    for split in ("train", "valid"):  # the count against every segment grouped
        for rank in range(world_size):
            batches = data.batches(split, rank, world_size)
            brute: dict[int, tuple[int, ...]] = {}
            for _, y in batches:
                sizes = group_targets(y, cfg.cutoffs).sizes
                brute[y.numel()] = tuple(map(max, zip(brute.get(y.numel(), sizes), sizes)))
            assert most_targets_per_cluster(batches, cfg.cutoffs) == brute
