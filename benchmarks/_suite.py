"""The scenarios of headkit's benchmark suite (run them with ``benchmarks/run.py``).

Each scenario builds what it compares in one process and returns records (``_harness.record``)
whose ``ratio`` is headkit's cost over its floor or peer, measured alternated (see
``_harness.measure``). Only headkit's public API is used. Scenario letters follow issue 13:

  a  overhead      train step: headed model, one probe on the last layer ÷ bare HF model +
                   nn.Linear on last_hidden_state, same loss and optimizer (frozen backbone,
                   and trainable backbone)                                       goal <= 1.05
  b  early exit    forward (eval, no grad): probe on layer 2 ÷ probe on the last layer
                                                                                 goal <= 0.25
  c  many layers   train step: one probe on every hidden state (L+1 heads) ÷ one probe
                                                                                 goal <= 1.10
  d  one layer     train step: 25 sequence heads on the last layer, same pooling ÷ one
                                                                                 goal <= 1.05
  e  masked loss   train step, token CE head: padded batch with ignore_pads ÷ the same batch
                   with an all-ones mask and ignore_pads=False                   goal <= 1.03
  f  cached        10-epoch probe: cache pass + training on cached features ÷ 10 epochs
                   through the frozen backbone                                   goal <= 0.15
  g  memory        inference peak RSS: one head on layer L/2 ÷ bare model with
                   output_hidden_states=True (fresh process per measurement)     goal <  1
  h  checks        forward with per-batch input checks ÷ without (needs the check_inputs
                   switch)                                                       goal <= 1.02
  i  compile       torch.compile(fullgraph=True): compiles? compiled train step ÷ compiled
                   bare + nn.Linear                                              goal <= 1.05
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _harness import Goal, measure, peak_memory, plain_malloc_env, record, rss_now_mib
from _models import Sizes, build, call_kwargs, padded_mask, token_ids, truncated
from torch import nn
from torch.utils.data import DataLoader

from headkit import HeadConfig, HeadedModel, cache_features, train_heads_on_features

SCENARIOS = "abcdefghi"
HERE = Path(__file__).resolve().parent


@dataclass
class Context:
    """How to measure: sizes, step counts, load threshold, device and dtype."""

    sizes: Sizes
    warmup: int = 5
    steps: int = 20
    max_load: float = 0.2
    retries: int = 2
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 2
    cached_batches: int = 8  # (f): batches per epoch
    cached_epochs: int = 10
    mem_repeats: int = 3  # (g): fresh processes per measurement
    quiet_timeout: float = 0.0  # seconds to wait for a quiet machine before each attempt

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def tokens(self) -> int:
        return self.sizes.batch * self.sizes.seq

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def measure(self, fns: dict[str, Callable[[], object]], warmup: int | None = None, steps=None):
        return measure(
            fns,
            self.warmup if warmup is None else warmup,
            self.steps if steps is None else steps,
            self.max_load,
            self.retries,
            self.sync,
            self.quiet_timeout,
        )

    def model(self, arch: str) -> nn.Module:
        return build(arch, self.sizes).to(self.device, self.torch_dtype)

    def batch(self, padded: bool = False, seed: int = 1) -> dict[str, torch.Tensor]:
        s = self.sizes
        mask = padded_mask(s.batch, s.seq, seed + 1) if padded else torch.ones(s.batch, s.seq)
        return {
            "input_ids": token_ids(s.batch, s.seq, seed).to(self.device),
            "attention_mask": mask.long().to(self.device),
        }


# ---------------------------------------------------------------------- building blocks
def probe(name: str = "probe", layer: int = -1, **kw: Any) -> HeadConfig:
    """A token-level linear regression probe (MSE), the same function as the peer's Linear."""
    kw = {"num_outputs": 1, "is_regression": True, "loss_fct": "mse", "output_bias": True, **kw}
    return HeadConfig(name, layer_hook=layer, target="y", **kw)


class BareProbe(nn.Module):
    """The peer: a bare HF model plus one nn.Linear on ``last_hidden_state``, MSE loss.

    The Linear is float32 and reads the states cast to its dtype, as headkit's heads do.
    """

    def __init__(self, backbone: nn.Module, hidden: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.linear = nn.Linear(hidden, 1).to(next(backbone.parameters()).device)
        self.kw = call_kwargs(backbone)

    def forward(self, input_ids, attention_mask, y):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **self.kw)
        p = self.linear(h.last_hidden_state.to(self.linear.weight.dtype))  # (batch, seq, 1)
        return F.mse_loss(p.squeeze(-1), y)


def trainer(model: nn.Module, batch: dict[str, Any], lr: float = 1e-4) -> Callable[[], None]:
    """One optimizer step (AdamW over the trainable parameters) on ``batch``."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def step() -> None:
        out = model(**batch)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return fn()

    return run


def headed(base: nn.Module, heads: list[HeadConfig], **kw: Any) -> HeadedModel:
    """A HeadedModel on a private copy of ``base`` (so optimizer steps never meet)."""
    return HeadedModel(copy.deepcopy(base), heads, **kw)


def has_check_switch() -> bool:
    return "check_inputs" in inspect.signature(HeadedModel.__init__).parameters


def _copy_linear(dst: nn.Linear, src: nn.Linear) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        if dst.bias is not None and src.bias is not None:
            dst.bias.copy_(src.bias)


# ---------------------------------------------------------------------- scenarios
def scenario_a(ctx: Context, arch: str) -> list[dict]:
    base = ctx.model(arch)
    batch = {**ctx.batch(), "y": torch.randn(ctx.sizes.batch, ctx.sizes.seq, device=ctx.device)}
    out = []
    for variant, frozen in (("frozen", True), ("trainable", False)):
        hm = headed(base, [probe()], freeze_base_model=frozen).train()
        bare = BareProbe(copy.deepcopy(base), ctx.sizes.hidden)
        _copy_linear(bare.linear, hm.heads["probe"].linears[0])
        bare.train()
        if frozen:  # as HeadedModel does: no grad through the backbone, which stays in eval
            bare.backbone.requires_grad_(False)
            bare.backbone.eval()
        t = ctx.measure({"headkit": trainer(hm, batch), "bare": trainer(bare, batch)})
        out.append(
            record(
                "a",
                f"a_overhead_{variant}",
                arch,
                f"train step, {variant} backbone: probe on the last layer ÷ bare model + nn.Linear",
                t.ratio("headkit", "bare"),
                Goal("<=", 1.05),
                t.summary(ctx.tokens),
            )
        )
    return out


def scenario_b(ctx: Context, arch: str) -> list[dict]:
    base = ctx.model(arch)
    L = ctx.sizes.layers
    k = 2 if L >= 4 else 1
    batch = ctx.batch()
    kw = call_kwargs(base)
    probe_k = HeadedModel(base, [HeadConfig("probe", layer_hook=k, num_outputs=2)]).eval()
    probe_last = HeadedModel(base, [HeadConfig("probe", layer_hook=-1, num_outputs=2)]).eval()
    floor = truncated(base, probe_k.info.layers_path, k)
    lin = nn.Linear(ctx.sizes.hidden, 2).to(ctx.device, ctx.torch_dtype)
    fns = {
        "probe_k": lambda: probe_k(**batch),
        "probe_last": lambda: probe_last(**batch),
        "floor_k": lambda: floor(**batch, **kw),
        "bare_full": lambda: base(**batch, **kw),
        # the predecessor design: every block runs, every state is kept, the probe reads [k]
        "all_states_k": lambda: lin(
            base(**batch, output_hidden_states=True, **kw).hidden_states[k]
        ),
    }
    t = ctx.measure({n: no_grad(f) for n, f in fns.items()})
    details = t.summary(ctx.tokens)
    details.update(
        k=k,
        ideal=round(k / L, 4),
        probe_k_over_floor_k=round(t.ratio("probe_k", "floor_k"), 4),
        probe_k_over_bare_full=round(t.ratio("probe_k", "bare_full"), 4),
        probe_last_over_bare_full=round(t.ratio("probe_last", "bare_full"), 4),
        all_states_k_over_floor_k=round(t.ratio("all_states_k", "floor_k"), 4),
    )
    return [
        record(
            "b",
            "b_early_exit",
            arch,
            f"forward: probe on layer {k} ÷ probe on the last layer ({L})",
            t.ratio("probe_k", "probe_last"),
            Goal("<=", 0.25),
            details,
        )
    ]


def scenario_c(ctx: Context, arch: str) -> list[dict]:
    base = ctx.model(arch)
    L = ctx.sizes.layers
    batch = {**ctx.batch(), "y": torch.randn(ctx.sizes.batch, ctx.sizes.seq, device=ctx.device)}
    many = headed(base, [probe(f"p{i}", i) for i in range(L + 1)]).train()
    one = headed(base, [probe(f"p{L}", -1)]).train()
    t = ctx.measure({"many": trainer(many, batch), "one": trainer(one, batch)})
    return [
        record(
            "c",
            "c_heads_every_layer",
            arch,
            f"train step, frozen: one probe on every hidden state ({L + 1} heads) ÷ one probe",
            t.ratio("many", "one"),
            Goal("<=", 1.10),
            t.summary(ctx.tokens),
        )
    ]


#: Scenario d's heads: as many on the CPU as on the GPU run (24 layers + 1).
D_HEADS = 25


def scenario_d(ctx: Context, arch: str) -> list[dict]:
    base = ctx.model(arch)
    n = D_HEADS
    g = torch.Generator().manual_seed(3)
    batch = {
        **ctx.batch(padded=True),
        "cls": torch.randint(0, 2, (ctx.sizes.batch,), generator=g).to(ctx.device),
    }

    def seq_head(name: str) -> HeadConfig:
        return HeadConfig(
            name, layer_hook=-1, num_outputs=2, pred_for_sequence=True, pooling="mean", target="cls"
        )

    many = headed(base, [seq_head(f"s{i}") for i in range(n)]).train()
    one = headed(base, [seq_head("s0")]).train()
    t = ctx.measure({"many": trainer(many, batch), "one": trainer(one, batch)})
    return [
        record(
            "d",
            "d_heads_one_layer",
            arch,
            f"train step, frozen: {n} sequence heads on the last layer, mean pooling ÷ one",
            t.ratio("many", "one"),
            Goal("<=", 1.05),
            t.summary(ctx.tokens),
        )
    ]


def scenario_e(ctx: Context, arch: str) -> list[dict]:
    base = ctx.model(arch)
    s = ctx.sizes
    padded = ctx.batch(padded=True)
    real = padded["attention_mask"].bool()
    g = torch.Generator().manual_seed(4)
    labels = torch.randint(0, 17, (s.batch, s.seq), generator=g).to(ctx.device)
    labels = torch.where(real, labels, torch.full_like(labels, -100))  # pads never count

    def tagger(ignore_pads: bool) -> HeadedModel:
        cfg = HeadConfig("tags", layer_hook=-1, num_outputs=17, ignore_pads=ignore_pads)
        return headed(base, [cfg]).train()

    unpadded = {**padded, "attention_mask": torch.ones_like(padded["attention_mask"])}
    fns = {
        # padded batch, pads masked in attention and in the loss
        "masked": trainer(tagger(True), {**padded, "tags": labels}),
        # the same ids and labels, an all-ones mask, no pad masking in the loss
        "unmasked": trainer(tagger(False), {**unpadded, "tags": labels}),
        # padded mask in the backbone, no pad masking in the loss (isolates the loss's share)
        "masked_backbone_only": trainer(tagger(False), {**padded, "tags": labels}),
    }
    t = ctx.measure(fns)
    details = t.summary(ctx.tokens)
    details.update(
        pad_fraction=round(1 - float(real.float().mean()), 3),
        loss_masking_share=round(t.ratio("masked", "masked_backbone_only"), 4),
        backbone_masking_share=round(t.ratio("masked_backbone_only", "unmasked"), 4),
    )
    return [
        record(
            "e",
            "e_masked_token_loss",
            arch,
            "train step, token CE head: padded batch, pads masked ÷ same batch, all-ones mask, "
            "ignore_pads=False",
            t.ratio("masked", "unmasked"),
            Goal("<=", 1.03),
            details,
        )
    ]


def scenario_f(ctx: Context, arch: str) -> list[dict]:
    """Composed from alternated medians, so load drift between long runs cannot skew it:
    through = epochs x batches x (one train step through the backbone);
    cached  = (one cache_features pass over all batches) + (train_heads_on_features, all epochs).
    """
    base = ctx.model(arch)
    s = ctx.sizes
    g = torch.Generator().manual_seed(5)
    head = HeadConfig("cls", layer_hook=-1, num_outputs=2, pred_for_sequence=True, pooling="mean")
    batches = []
    for i in range(ctx.cached_batches):
        b = ctx.batch(padded=True, seed=10 + 2 * i)
        b["cls"] = torch.randint(0, 2, (s.batch,), generator=g).to(ctx.device)
        batches.append(b)
    through = headed(base, [head]).train()
    opt = torch.optim.AdamW([p for p in through.parameters() if p.requires_grad], lr=1e-3)
    turn = itertools.cycle(batches)

    def step() -> None:  # one step of an epoch through the frozen backbone
        out = through(**next(turn))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    cached_model = headed(base, [head])
    feats = cache_features(cached_model, DataLoader(batches, batch_size=None), progress=False)

    def cache_pass() -> None:
        cache_features(cached_model, DataLoader(batches, batch_size=None), progress=False)

    def cached_training() -> None:
        train_heads_on_features(
            cached_model, feats, epochs=ctx.cached_epochs, batch_size=s.batch, lr=1e-3
        )

    t = ctx.measure({"step": step, "cache_pass": cache_pass, "cached_training": cached_training})
    through_s = ctx.cached_epochs * len(batches) * t.median["step"]
    cached_s = t.median["cache_pass"] + t.median["cached_training"]
    details = t.summary()
    details.update(
        epochs=ctx.cached_epochs,
        sequences=len(batches) * s.batch,
        through_s=round(through_s, 3),
        cache_pass_s=round(t.median["cache_pass"], 4),
        cached_training_s=round(t.median["cached_training"], 4),
        cache_pass_over_epoch=round(t.median["cache_pass"] / (len(batches) * t.median["step"]), 4),
    )
    return [
        record(
            "f",
            "f_cached_features",
            arch,
            f"{ctx.cached_epochs}-epoch sequence probe: cache pass + training on cached features "
            "÷ through the frozen backbone",
            cached_s / through_s,
            Goal("<=", 0.15),
            details,
        )
    ]


MEMORY_KINDS = ("built", "bare", "bare_all_states", "headed_mid")


def memory_child(spec: dict) -> dict:
    """In a fresh process: build one scenario of (g) and measure its inference peak."""
    torch.set_num_threads(spec["threads"])
    sizes = Sizes(**spec["sizes"])
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    model = build(spec["arch"], sizes).to(device, dtype)
    kw = call_kwargs(model)
    ids = token_ids(sizes.mem_batch, sizes.mem_seq).to(device)
    mask = torch.ones_like(ids)
    mid = sizes.layers // 2
    hm = HeadedModel(model, [HeadConfig("probe", layer_hook=mid, num_outputs=2)]).eval()
    fns = {
        "bare": lambda: model(input_ids=ids, attention_mask=mask, **kw),
        "bare_all_states": lambda: model(
            input_ids=ids, attention_mask=mask, output_hidden_states=True, **kw
        ),
        "headed_mid": lambda: hm(input_ids=ids, attention_mask=mask),
    }
    kind = spec["kind"]
    if kind == "built":
        return rss_now_mib()
    fn = fns[kind]
    with torch.inference_mode():
        # one-time costs (thread pools, kernel choice, lazy buffers) on a tiny input first,
        # so the peak below is the scenario's, without growing the allocator beforehand
        small = {"input_ids": ids[:1, :8], "attention_mask": mask[:1, :8]}
        model(**small, **kw)
        hm(**small)
        if device == "cuda":
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            return {"increment_mib": (peak - before) / 2**20, "cuda_peak_mib": peak / 2**20}
        return peak_memory(fn)


def _run_memory_child(ctx: Context, arch: str, kind: str) -> dict:
    spec = {
        "arch": arch,
        "kind": kind,
        "sizes": asdict(ctx.sizes),
        "device": ctx.device,
        "dtype": ctx.dtype,
        "threads": ctx.threads,
    }
    cmd = [sys.executable, str(HERE / "_suite.py"), "--memory-child", json.dumps(spec)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=plain_malloc_env())
    if res.returncode != 0:
        raise RuntimeError(f"memory process for {kind} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def scenario_g(ctx: Context, arch: str) -> list[dict]:
    runs: dict[str, list[dict]] = {k: [] for k in MEMORY_KINDS}
    for _ in range(ctx.mem_repeats):
        for kind in MEMORY_KINDS:  # alternated, like the timings
            runs[kind].append(_run_memory_child(ctx, arch, kind))

    def med(kind: str, key: str) -> float | None:
        vals = [r[key] for r in runs[kind] if r.get(key) is not None]
        return round(statistics.median(vals), 1) if vals else None

    built = med("built", "peak_mib")
    inc = {}
    for kind in MEMORY_KINDS[1:]:
        inc[kind] = med(kind, "increment_mib")
        if inc[kind] is None and built is not None and med(kind, "peak_mib") is not None:
            inc[kind] = round(med(kind, "peak_mib") - built, 1)  # peak counter not resettable
    details = {
        "batch": f"{ctx.sizes.mem_batch} x {ctx.sizes.mem_seq}",
        "head_layer": ctx.sizes.layers // 2,
        "increment_mib": inc,
        "peak_rss_mib": {k: med(k, "peak_mib") for k in MEMORY_KINDS},
        "rss_before_mib": {k: med(k, "rss_before_mib") for k in MEMORY_KINDS[1:]},
        "built_rss_mib": med("built", "rss_mib"),
        "processes_per_kind": ctx.mem_repeats,
        "method": (
            "CUDA max_memory_allocated above allocated before"
            if ctx.device == "cuda"
            else "fresh process per run, plain glibc; peak RSS (VmHWM, reset via "
            "/proc/self/clear_refs after building and a tiny warm-up call) above the RSS before "
            "two inference calls"
        ),
    }
    if inc["bare_all_states"]:
        details["headed_mid_over_bare"] = (
            round(inc["headed_mid"] / inc["bare"], 3) if inc["bare"] else None
        )
    ratio = inc["headed_mid"] / inc["bare_all_states"] if inc["bare_all_states"] else None
    return [
        record(
            "g",
            "g_inference_memory",
            arch,
            f"inference peak memory above the built model: head on layer "
            f"{ctx.sizes.layers // 2} ÷ bare model with output_hidden_states=True",
            ratio,
            Goal("<", 1.0),
            details,
            status="ok" if ratio is not None else "error",
        )
    ]


def scenario_h(ctx: Context, arch: str) -> list[dict]:
    figure = "forward with labels, eval: per-batch input checks on ÷ off"
    if not has_check_switch():
        return [
            record(
                "h",
                "h_input_checks",
                arch,
                figure,
                None,
                Goal("<=", 1.02),
                status="n/a",
                note="n/a (needs check_inputs switch: HeadedModel(..., check_inputs=False))",
            )
        ]
    base = ctx.model(arch)
    padded = ctx.batch(padded=True)
    g = torch.Generator().manual_seed(6)
    labels = torch.randint(0, 17, (ctx.sizes.batch, ctx.sizes.seq), generator=g).to(ctx.device)
    batch = {**padded, "tags": labels}
    fns = {}
    for layer in (-1, 2):
        for on in (True, False):
            cfg = HeadConfig("tags", layer_hook=layer, num_outputs=17)
            hm = HeadedModel(base, [cfg], check_inputs=on).eval()
            fns[f"{'on' if on else 'off'}_{layer}"] = no_grad(lambda hm=hm: hm(**batch))
    t = ctx.measure(fns)
    details = t.summary(ctx.tokens)
    details["layer_2_on_over_off"] = round(t.ratio("on_2", "off_2"), 4)
    return [
        record(
            "h",
            "h_input_checks",
            arch,
            figure,
            t.ratio("on_-1", "off_-1"),
            Goal("<=", 1.02),
            details,
        )
    ]


def scenario_i(ctx: Context, arch: str) -> list[dict]:
    import torch._dynamo

    base = ctx.model(arch)
    batch = {**ctx.batch(), "y": torch.randn(ctx.sizes.batch, ctx.sizes.seq, device=ctx.device)}
    switch = has_check_switch()
    hm = headed(base, [probe()], **({"check_inputs": False} if switch else {})).train()
    bare = BareProbe(copy.deepcopy(base), ctx.sizes.hidden)
    _copy_linear(bare.linear, hm.heads["probe"].linears[0])
    bare.backbone.requires_grad_(False)
    bare.backbone.eval()
    checks = "checks off" if switch else "checks on (no check_inputs switch yet)"

    def compiled_step(model: nn.Module, fullgraph: bool) -> tuple[Callable[[], None], float]:
        step = trainer(torch.compile(model, fullgraph=fullgraph), batch)
        t0 = time.perf_counter()
        step()  # compiles forward and backward
        ctx.sync()
        return step, time.perf_counter() - t0

    torch._dynamo.reset()
    bare_step, bare_compile_s = compiled_step(bare, True)
    details: dict[str, Any] = {"checks": checks, "bare_compile_s": round(bare_compile_s, 1)}
    failure = None
    try:
        head_step, head_compile_s = compiled_step(hm, True)
    except Exception as e:  # the model does not compile as one graph yet: say why
        failure = _compile_failure(e)
        details["fullgraph_error"] = f"{type(e).__name__}: " + " ".join(str(e).split())[:600]
        try:
            explain = torch._dynamo.explain(hm)(**batch)
            details["graph_breaks"] = explain.graph_break_count
            details["break_reasons"] = [_break_reason(r) for r in explain.break_reasons[:8]]
        except Exception as e2:  # explain itself may fail; keep the first reason
            details["explain_error"] = f"{type(e2).__name__}: {str(e2)[:300]}"
        torch._dynamo.reset()
        head_step, head_compile_s = compiled_step(hm, False)
    details["headkit_compile_s"] = round(head_compile_s, 1)
    out = [
        record(
            "i",
            "i_compile_fullgraph",
            arch,
            f"torch.compile(HeadedModel, fullgraph=True) compiles, {checks}",
            None,
            None,
            {k: v for k, v in details.items() if k not in ("bare_compile_s",)},
            status="failed" if failure else "ok",
            note=failure or "compiles as one graph",
        )
    ]
    out[0]["goal"], out[0]["met"] = "compiles", failure is None
    t = ctx.measure({"headkit": head_step, "bare": bare_step})
    d = t.summary(ctx.tokens)
    d.update(details)
    out.append(
        record(
            "i",
            "i_compiled_step",
            arch,
            "compiled train step, frozen: probe on the last layer ÷ compiled bare + nn.Linear",
            t.ratio("headkit", "bare"),
            Goal("<=", 1.05),
            d,
            note="" if failure is None else "headed model compiled with fullgraph=False",
        )
    )
    return out


def _compile_failure(e: Exception) -> str:
    """A line: the error's first sentence and where in headkit (or the user's code) it arose."""
    text = " ".join(str(e).split())
    sentences = text.split(". ")
    keys = ("Could not", "Unsupported", "not supported", "data-dependent", "graph break")
    first = next((x for x in sentences if any(k in x for k in keys)), sentences[0])[:200]
    where = re.findall(r"([\w/.-]+\.py):(\d+) in (\w+)", text)
    at = next((w for w in where if "headkit/" in w[0]), where[0] if where else None)
    loc = f" at {Path(at[0]).name}:{at[1]} ({at[2]})" if at else ""
    return f"{type(e).__name__}{loc}: {first}"


def _break_reason(r: Any) -> str:
    """ "file:line (function): reason" of a dynamo graph break, in the user's code."""
    stack = getattr(r, "user_stack", None) or []
    where = (
        f"{Path(stack[-1].filename).name}:{stack[-1].lineno} ({stack[-1].name}): " if stack else ""
    )
    return where + " ".join(str(r.reason).split())[:160]


RUNNERS = {
    "a": scenario_a,
    "b": scenario_b,
    "c": scenario_c,
    "d": scenario_d,
    "e": scenario_e,
    "f": scenario_f,
    "g": scenario_g,
    "h": scenario_h,
    "i": scenario_i,
}


def run_scenario(ctx: Context, letter: str, arch: str) -> list[dict]:
    """Run one scenario; an exception becomes an "error" record (the suite goes on)."""
    torch.manual_seed(0)
    try:
        return RUNNERS[letter](ctx, arch)
    except Exception as e:
        return [
            record(
                letter,
                f"{letter}_error",
                arch,
                f"scenario {letter}",
                None,
                status="error",
                note=f"{type(e).__name__}: {e}",
                details={"traceback": traceback.format_exc()},
            )
        ]


if __name__ == "__main__" and sys.argv[1:2] == ["--memory-child"]:
    print(json.dumps(memory_child(json.loads(sys.argv[2]))))
