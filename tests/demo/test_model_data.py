"""The demo's corpus is deterministic next-byte text; its model is shaped like Qwen3."""

from __future__ import annotations

import pytest
import torch

import canzona
from canzona.demo.data import Corpus, generate_text, shard_rows
from canzona.demo.model import DecoderConfig, QwenDecoder


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
