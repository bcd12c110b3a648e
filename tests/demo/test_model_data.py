"""The demo's corpus is deterministic next-byte text; its model is shaped like Qwen3."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import canzona
from canzona.demo.cli import summary_lines
from canzona.demo.data import Corpus, generate_text, shard_rows
from canzona.demo.model import DecoderConfig, QwenDecoder
from canzona.demo.train import DemoSettings, RunResult, _schedule


def test_corpus_is_deterministic_ascii_with_every_kind_of_line() -> None:
    text = generate_text(20_000)
    assert text == generate_text(20_000)
    assert text != generate_text(20_000, seed=1)
    decoded = text.decode("ascii")
    for marker in ("what color is", "+", "=", "count ", " the "):
        assert marker in decoded


def test_batches_are_next_byte_windows_and_split_over_ranks() -> None:
    corpus = Corpus(50_000)
    x, y = corpus.batch(3, 8, 32, seed=0)
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = corpus.batch(3, 8, 32, seed=0)
    assert torch.equal(x, x2)
    assert not torch.equal(x, corpus.batch(4, 8, 32, seed=0)[0])
    halves = [shard_rows(x, r, 2) for r in range(2)]
    assert torch.equal(torch.cat(halves), x)
    with pytest.raises(ValueError, match="does not split"):
        shard_rows(x, 0, 3)


def test_model_shapes_loss_and_routing() -> None:
    torch.manual_seed(0)
    cfg = DecoderConfig(n_layers=2)
    model = QwenDecoder(cfg)
    tokens = torch.randint(0, 256, (2, 16))
    assert model(tokens).shape == (2, 16, 256)
    loss = model(tokens, tokens)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 1.0  # near uniform at init
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" in names
    matrix, adamw = canzona.param_groups(model)
    assert adamw["algorithm"] == "adamw"
    adamw_names = {n for n, _ in adamw["params"]}
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight"} <= adamw_names
    assert len(matrix["params"]) == 7 * cfg.n_layers  # q, k, v, o, gate, up, down


def test_config_and_length_are_checked() -> None:
    with pytest.raises(ValueError, match="n_kv_heads must divide n_heads"):
        DecoderConfig(n_heads=4, n_kv_heads=3)
    model = QwenDecoder(DecoderConfig(n_layers=1, max_seq_len=8))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DemoSettings(world=2, batch_size=3), "batch_size 3 must split over 2 ranks"),
        (lambda: DemoSettings(seq_len=10**6), "seq_len 1000000 exceeds max_seq_len"),
        (lambda: DemoSettings(timing_steps=-1), "timing_steps must be >= 0, got -1"),
        (lambda: generate_text(0), "num_bytes must be positive, got 0"),
        (lambda: Corpus(1000, eval_fraction=1.0), r"eval_fraction must be in \(0, 1\), got 1.0"),
        (lambda: DecoderConfig(head_dim=7), "head_dim must be even"),
    ],
)
def test_bad_demo_values_are_named_before_any_rank_starts(
    build: Callable[[], object], message: str
) -> None:
    """Catches: a bad setting let through to fail later, inside the ranks, with another error."""
    with pytest.raises(ValueError, match=message):
        build()


def test_a_sequence_of_exactly_max_seq_len_tokens_runs() -> None:
    model = QwenDecoder(DecoderConfig(n_layers=1, max_seq_len=8))
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, model.cfg.vocab_size)


def test_output_projections_start_smaller_with_depth() -> None:
    """Catches: the residual branches' outputs (o_proj, down_proj) initialised like the rest."""
    torch.manual_seed(0)
    cfg = DecoderConfig(n_layers=8)
    model = QwenDecoder(cfg)
    layer = model.layers[0]
    for linear, scaled in ((layer.self_attn.o_proj, True), (layer.mlp.up_proj, False)):
        expected = linear.in_features**-0.5 / (math.sqrt(2 * cfg.n_layers) if scaled else 1)
        assert float(linear.weight.detach().std()) == pytest.approx(expected, rel=0.05)


def test_the_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    factor = _schedule(80)  # warm-up over the first 10% of the steps
    assert [factor(0), factor(7), factor(8)] == [1 / 8, 1.0, 1.0]
    assert factor(79) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 71 / 72)))
    assert 0.1 < factor(79) < factor(44) < 1.0


def _run(label: str, start: float, end: float) -> RunResult:
    return RunResult(
        label=label, losses=[start, end], eval_start=start, eval_end=end, step_s=[], optimizer_s=[]
    )


def test_the_summary_reports_the_runs_the_timings_and_the_plan() -> None:
    """Catches: the AdamW verdict or the step ratio turned around, and the balance ratio
    taken from the least loaded rank."""
    result = {
        "runs": {"canzona": _run("canzona Muon", 3.0, 1.49), "adamw": _run("AdamW", 3.0, 1.5)},
        "timings": {
            "canzona": {"step_s": 1e-3, "compute_s": 5e-4},
            "replicated": {"step_s": 2e-3, "compute_s": 1.5e-3},
        },
        "plan": {"owner_s": [1e-3, 3e-3], "matrices": 14, "num_ranks": 2, "micro_groups": 1},
    }
    text = "\n".join(summary_lines(result, DemoSettings(world=2, timing_steps=6)))
    assert "canzona Muon ends 0.010 nats/byte below AdamW on the held-out batch" in text
    assert "canzona plan 1.0 ms, replicated plan 2.0 ms (2.00x)" in text
    assert "matrix compute: canzona 0.5 ms, replicated 1.5 ms" in text
    assert "1.0/3.0 ms, balance ratio 1.500 (max / mean)" in text
    result["runs"]["canzona"] = _run("canzona Muon", 3.0, 1.5004)
    text = "\n".join(summary_lines(result, DemoSettings(world=2)))
    assert "canzona Muon ends level with AdamW" in text
    result["runs"]["canzona"] = _run("canzona Muon", 3.0, 1.52)
    text = "\n".join(summary_lines(result, DemoSettings(world=2)))
    assert "ends 0.020 nats/byte above AdamW" in text
