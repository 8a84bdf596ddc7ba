"""Example models for pipeline tests and benchmarks: a chain and three multi-branch
models of the kinds GraphPipe targets. All trace with torch.fx.

`build(name, dtype)` returns a `ModelSpec`: the module, a batch maker and the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def _mlp(sizes: list[int], last_act: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if last_act or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ChainMLP(nn.Module):
    """A plain chain of Linear+ReLU layers (the sequential pipeline's home ground)."""

    def __init__(self, in_dim: int = 64, width: int = 256, depth: int = 8, out: int = 8) -> None:
        super().__init__()
        self.body = _mlp([in_dim] + [width] * depth, last_act=True)
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class TwoTowerTransformer(nn.Module):
    """Multi-modal: a text tower (embedding + encoder) and an image tower (patch
    projection + encoder), pooled, concatenated, then a head."""

    def __init__(self, vocab: int = 256, patch_dim: int = 48, d: int = 64, layers: int = 2,
                 heads: int = 4, ff: int = 128, out: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.patch = nn.Linear(patch_dim, d)
        self.text = nn.Sequential(*[nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0,
                                                               batch_first=True)
                                    for _ in range(layers)])
        self.image = nn.Sequential(*[nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0,
                                                                batch_first=True)
                                     for _ in range(layers)])
        self.head = _mlp([2 * d, d, out], last_act=False)

    def forward(self, tokens: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        t = self.text(self.embed(tokens)).mean(dim=1)
        v = self.image(self.patch(patches)).mean(dim=1)
        return self.head(torch.cat([t, v], dim=1))


class DLRM(nn.Module):
    """DLRM-like: a bottom MLP on dense features and embedding tables for sparse ones,
    pairwise dot-product interaction, a top MLP."""

    def __init__(self, dense: int = 16, tables: int = 4, vocab: int = 1000, d: int = 32,
                 bottom: int = 256, top: int = 256, out: int = 1) -> None:
        super().__init__()
        self.tables = tables
        self.bottom = _mlp([dense, bottom, bottom, d])
        self.embs = nn.ModuleList([nn.Sequential(nn.Embedding(vocab, d), _mlp([d, d]))
                                   for _ in range(tables)])
        n = tables + 1
        self.top = _mlp([n * n + d, top, top, out], last_act=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        feats = [x] + [emb(sparse[:, i]) for i, emb in enumerate(self.embs)]
        z = torch.stack(feats, dim=1)
        inter = torch.bmm(z, z.transpose(1, 2)).flatten(1)
        return self.top(torch.cat([x, inter], dim=1))


class CandleUno(nn.Module):
    """CANDLE-Uno-like: one MLP tower per input (cell expression, two drugs), concatenated
    into a deep top MLP."""

    def __init__(self, dims: tuple[int, ...] = (128, 256, 256), tower: int = 256,
                 depth: int = 3, top: int = 256, top_depth: int = 2, out: int = 1) -> None:
        super().__init__()
        self.towers = nn.ModuleList([_mlp([d] + [tower] * depth) for d in dims])
        self.top = _mlp([tower * len(dims)] + [top] * top_depth + [out], last_act=False)

    def forward(self, cell: torch.Tensor, drug1: torch.Tensor, drug2: torch.Tensor
                ) -> torch.Tensor:
        feats = [t(x) for t, x in zip(self.towers, (cell, drug1, drug2), strict=True)]
        return self.top(torch.cat(feats, dim=1))


class TiedLM(nn.Module):
    """A language model's shape in small: a token embedding, mixing layers, and an
    output layer whose weight *is* the embedding's (`head.weight = embed.weight`, as
    most language models tie them): one parameter held by two ops at the two ends of
    the model, which the pipeline may put on different stages (each holds a copy)."""

    def __init__(self, vocab: int = 1000, d: int = 256, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh())
                                   for _ in range(depth)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(tokens)))


@dataclass
class ModelSpec:
    """A model with its data.

    Args:
        name: registry name.
        module: the model.
        make_batch: (batch size, seed) -> (inputs by forward-argument name, target).
        loss: (output, target) -> scalar (a mean over the batch, so micro-batch losses
            average to the full-batch loss).
    """

    name: str
    module: nn.Module
    make_batch: Callable[[int, int], tuple[dict[str, torch.Tensor], torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
          small: bool = False) -> ModelSpec:
    """Construct an example model with fixed-seed weights.

    Args:
        name: "chain", "two_tower", "dlrm", "uno" or "tied_lm".
        dtype: parameter and input dtype (float64 for the gradient-equality tests).
        seed: weight seed.
        small: tiny sizes (tests).

    Returns:
        The model spec.

    Raises:
        KeyError: unknown name; the message lists the known ones.
    """
    torch.manual_seed(seed)
    if name == "chain":
        m = ChainMLP(16, 32, 4) if small else ChainMLP()
        dims = {"x": m.body[0].in_features}
    elif name == "two_tower":
        m = TwoTowerTransformer(d=16, ff=32, layers=1, heads=2) if small else TwoTowerTransformer()
        dims = {}
    elif name == "dlrm":
        m = DLRM(bottom=32, top=32, d=8, vocab=50) if small else DLRM()
        dims = {"dense": m.bottom[0].in_features}
    elif name == "uno":
        m = CandleUno((8, 12, 10), 16, 2, 16) if small else CandleUno()
        dims = {n: t[0].in_features for n, t in zip(("cell", "drug1", "drug2"), m.towers,
                                                     strict=True)}
    elif name == "tied_lm":
        m = TiedLM(40, 16, 3) if small else TiedLM()
        dims = {}
    else:
        raise KeyError(f"unknown model {name!r}: use one of {sorted(MODELS + TEST_MODELS)}")
    m = m.to(dtype)
    if name == "tied_lm":
        return _language_model(name, m)
    out_dim = _out_features(m)

    def make_batch(b: int, data_seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(data_seed)
        if name == "two_tower":
            feeds = {"tokens": torch.randint(0, m.embed.num_embeddings, (b, 16), generator=g),
                     "patches": torch.randn(b, 16, m.patch.in_features, generator=g,
                                            dtype=dtype)}
        elif name == "dlrm":
            feeds = {"dense": torch.randn(b, dims["dense"], generator=g, dtype=dtype),
                     "sparse": torch.randint(0, m.embs[0][0].num_embeddings, (b, m.tables),
                                             generator=g)}
        else:
            feeds = {k: torch.randn(b, v, generator=g, dtype=dtype) for k, v in dims.items()}
        return feeds, torch.randn(b, out_dim, generator=g, dtype=dtype)

    return ModelSpec(name, m, make_batch, nn.functional.mse_loss)


def _language_model(name: str, m: TiedLM) -> ModelSpec:
    """Next-token data for a language model: a token in, a class over the vocabulary out."""
    vocab = m.embed.num_embeddings

    def make_batch(b: int, data_seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(data_seed)
        return ({"tokens": torch.randint(0, vocab, (b,), generator=g)},
                torch.randint(0, vocab, (b,), generator=g))

    return ModelSpec(name, m, make_batch, nn.functional.cross_entropy)


def _out_features(m: nn.Module) -> int:
    last = [x for x in m.modules() if isinstance(x, nn.Linear)][-1]
    return last.out_features


MODELS = ("chain", "two_tower", "dlrm", "uno")  # the ones the benchmark runs
# built for the tests (tied weights across stages), not benchmarked: a chain, which says
# nothing about GraphPipe
TEST_MODELS = ("tied_lm",)
