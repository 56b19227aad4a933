"""Compiled decode steps in gpt-fast's way, with a record of what really ran.

    from pipeline.decode.compiled import CompileSession, step_shapes
    session = CompileSession(backend="inductor", mode="reduce-overhead")
    session.attach(model, "target"); session.expect(step_shapes("target", 1, L, widths=[1]))
    generate(model, ids, 64, cache_len=L)    # prefill eager; the planned decode steps compiled
    session.record(); session.close()        # per shape: compiled or eager (+ why); detach, reset dynamo

One function, `_step` (B rows x W new tokens on a static cache), is compiled with fullgraph once
per planned shape (the verify widths may share one graph with a symbolic width). torch.compile
falls back to eager silently, so here every fallback is an error or a recorded reason, and inputs
are copied fresh because dynamo guards on strides (docs/methods/gpu-box.md#what-is-compiled).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import asdict, dataclass

import torch

from pipeline.decode.cache import CachedModel, attach_session, attached_session, detach_session, hf_model

# The dynamo settings a session sets (and restores on close). Names differ across torch versions
# (recompile_limit was cache_size_limit before 2.6): only those that exist are set, and the record
# lists what was set.
_LIMIT_NAMES = (("recompile_limit", "cache_size_limit"),
                ("accumulated_recompile_limit", "accumulated_cache_size_limit"))

def _step(model, kwarg: str, tokens: torch.Tensor, positions: torch.Tensor, cache, logits_to_keep: int):
    """tokens, positions: [B, W] -> logits [B, W or 1, V]: the forward every step makes."""
    out = model(input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=logits_to_keep,
                **{kwarg: cache})
    return out.logits


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


@dataclass
class ShapeRecord:
    model: str
    batch: int
    width: int
    cache_len: int
    all_logits: bool
    ran: str = "compiled"  # "compiled" or "eager"
    reason: str | None = None  # why eager
    calls: int = 0
    compiled_calls: int = 0
    graphs: int = 0  # graphs dynamo made for this shape (1 when it compiled once)
    recompiles: int = 0  # graphs made after the first call (a guard failed: should stay 0)
    compile_s: float = 0.0  # wall time of the first call (tracing + backend compile + one run)
    cudagraph_skips: int = 0  # inductor's count of graphs it ran without a CUDA graph
    # Traced with a symbolic width (CompileSession dynamic_width): the first width of its group to
    # run makes the group's graph (graphs 1), the others reuse it (graphs 0).
    dynamic_width: bool = False
    record_s: float = 0.0  # warm's second call (on CUDA: recording the shape's CUDA graph)


class CompileSession:
    """One torch.compile of `_step` shared by the models attached to it, and the record of every
    shape it was asked to run."""

    def __init__(self, backend="inductor", mode: str | None = "reduce-overhead", fullgraph: bool = True,
                 dynamic_width: bool = False):
        self.backend = backend
        self.dynamic_width = dynamic_width
        self.mode = mode if backend == "inductor" else None  # modes belong to inductor
        self.expected: set[tuple] = set()
        self.fullgraph = fullgraph
        # A fresh dynamo state: graphs of earlier sessions (earlier models) would count against
        # this session's limit, and their guards hold the earlier models.
        torch._dynamo.reset()
        self._saved: dict[str, object] = {}
        self.settings: dict[str, object] = {}
        self._set_config()
        kwargs = {"mode": self.mode} if self.mode else {}
        self.fn = torch.compile(_step, backend=backend, dynamic=False, fullgraph=fullgraph, **kwargs)
        self.shapes: dict[tuple, ShapeRecord] = {}
        self.model_failed: dict[str, str] = {}  # label -> reason: a graph break fails every shape
        self.current: tuple | None = None  # the shape being run (a counting test backend reads it)
        self._models: list = []
        self.closed = False

    # ------------------------------------------------------------ dynamo settings

    def _set_config(self) -> None:
        cfg = torch._dynamo.config
        wanted = {"fail_on_recompile_limit_hit": True, "suppress_errors": False}
        for names in _LIMIT_NAMES:
            name = next((n for n in names if hasattr(cfg, n)), None)
            if name is not None:
                # The expected graphs, plus one (dynamo counts the entry being added); never lower.
                base = self._saved.get(name, getattr(cfg, name))
                # One per expected shape even when widths share graphs: a model whose code fixes
                # the width (a specialisation) then compiles a graph per width, as without
                # dynamic_width, and the record shows more graphs than planned.
                wanted[name] = max(int(base), len(self.expected) + 1)
        for name, value in wanted.items():
            if hasattr(cfg, name):
                self._saved.setdefault(name, getattr(cfg, name))
                setattr(cfg, name, value)
                self.settings[name] = value
        if getattr(cfg, "disable", False):
            self.model_failed["*"] = "torch._dynamo.config.disable is set (TORCHDYNAMO_DISABLE): nothing compiles"

    def close(self) -> None:
        """Detach every model, restore dynamo's settings, drop the compiled graphs."""
        if self.closed:
            return
        for ref in self._models:
            m = ref()
            if m is not None:
                detach_session(m, self)
        for name, value in self._saved.items():
            setattr(torch._dynamo.config, name, value)
        torch._dynamo.reset()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ running

    @property
    def max_graphs(self) -> int:
        """The graphs the plan needs: one per expected shape, or per width group (dynamic_width)."""
        return len(graph_groups(self.expected, self.dynamic_width))

    def new_graphs(self, shapes) -> int:
        """How many graphs running `shapes` would compile now: their width groups of which no
        shape has run compiled yet (a planning figure; a shape outside the plan compiles none)."""
        made = {graph_key(k, self.dynamic_width) for k, r in self.shapes.items() if r.ran == "compiled"}
        todo = {graph_key(k, self.dynamic_width) for k in shapes if k in self.expected}
        return len(todo - made)

    def _shares_graph(self, key: tuple) -> bool:
        """Whether `key` is planned in a width group of two or more shapes (one symbolic graph)."""
        if key not in self.expected:
            return False
        return len(graph_groups(self.expected, self.dynamic_width).get(graph_key(key, self.dynamic_width), [])) > 1

    def expect(self, shapes) -> None:
        """Plan these shapes (keys from step_shapes) for compiling; raises dynamo's limits to cover
        every expected shape. May be called again as a run learns its cache lengths."""
        self.expected.update(shapes)
        self._set_config()

    def attach(self, model, label: str) -> None:
        """Route `model`'s cached steps (not its prefill) through this session."""
        hf = hf_model(model)
        attach_session(hf, self, label)
        self._models.append(weakref.ref(hf))

    def warm(self, model, slot: str = "target", shapes=None) -> int:
        """Compile `model`'s expected shapes (or those of `shapes`) now, each on the pooled cache
        of `slot` that the real runs will use (exact length: an eager one-token prefill, then
        steps of the shape's width), so no compile lands in a timed run, including shapes a warm-up
        run may not reach (a draft's 2-token catch-up comes only after a fully accepted round).
        The cache stays pooled for the run, so CUDA graphs see the addresses they recorded.
        Each shape runs twice, at the same position: inductor's CUDA graph trees run a new graph
        (and, with dynamic widths, each new width) once as a warm-up in their memory pool and
        record it on the next call, so a single call here would leave the recording to the first
        timed run; the second call's time is the shape's `record_s`. Returns how many shapes it
        ran (graphs made: graphs_compiled() before and after)."""
        hf = hf_model(model)
        label = attached_session(hf)[1]
        pool = self.expected if shapes is None else set(shapes) & self.expected
        todo = sorted(k for k in pool if k[0] == label and k not in self.shapes)
        with torch.inference_mode():
            for _, batch, width, length, all_logits in todo:
                cached = CachedModel(hf, batch, length, slot=slot, exact=True)
                device = cached.device
                cached.prefill(torch.zeros(batch, 1, dtype=torch.long, device=device))
                tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
                cached.forward(tokens, all_logits)  # compile (+ the CUDA graph's warm-up run)
                cached.rollback(1)
                t0 = time.perf_counter()
                cached.forward(tokens, all_logits)  # the CUDA graph's recording
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                rec = self.shapes.get((label, batch, width, cached.max_len, all_logits))
                if rec is not None and rec.ran == "compiled":
                    rec.record_s = time.perf_counter() - t0
        return len(todo)

    def warm_pair(self, model, draft_model=None, shapes=None) -> tuple[int, int]:
        """warm() for a target (slot "target") and, if given, its draft model (slot "draft"):
        returns (step shapes run, graphs this added to the session)."""
        before = self.graphs_compiled()
        ran = self.warm(model, "target", shapes)
        if draft_model is not None:
            ran += self.warm(draft_model, "draft", shapes)
        return ran, self.graphs_compiled() - before

    def run(self, label: str, cached, tokens: torch.Tensor, positions: torch.Tensor, all_logits: bool):
        """One step of `cached` (a CachedModel whose cache an eager forward initialised):
        compiled when it can be, else eager; returns the logits and records which it was."""
        b, w = tokens.shape
        key = (label, b, w, cached.max_len, all_logits)
        rec = self.shapes.get(key)
        first = rec is None
        if first:
            rec = self.shapes[key] = ShapeRecord(label, b, w, cached.max_len, all_logits,
                                                 dynamic_width=self._shares_graph(key))
            reason = self.model_failed.get("*") or self.model_failed.get(label)
            if reason is None and key not in self.expected:
                reason = "not in the compile plan (run eagerly, as planned)"
            if reason is not None:
                rec.ran, rec.reason = "eager", reason
        rec.calls += 1
        if rec.ran == "eager":
            return cached.eager_forward(tokens, positions, all_logits)
        before, skips = _graph_count(), _cudagraph_skips()
        t0 = time.perf_counter()
        self.current = key
        try:
            if tokens.device.type == "cuda":
                # The previous step's outputs are consumed: CUDA graphs may reuse their memory.
                torch.compiler.cudagraph_mark_step_begin()
            # Fresh row-major copies (a few integers): dynamo guards on strides (see the docstring).
            tokens_in = tokens.new_empty(tokens.shape).copy_(tokens)
            positions_in = positions.new_empty(positions.shape).copy_(positions)
            if rec.dynamic_width:  # one graph for the group's widths: trace the width symbolically
                torch._dynamo.maybe_mark_dynamic(tokens_in, 1)
                torch._dynamo.maybe_mark_dynamic(positions_in, 1)
            logits = self.fn(cached.model, cached.kwarg, tokens_in, positions_in, cached.cache,
                             0 if all_logits else 1)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any compile failure becomes an explicit, recorded fallback
            if not first:
                raise  # a shape that compiled and ran before: a real runtime error
            rec.ran, rec.reason = "eager", _reason(e)
            if _is_graph_break(e):
                self.model_failed[label] = rec.reason  # every shape of this model would break the same way
            cached.resync()  # a failed call may have moved the cache's offset
            return cached.eager_forward(tokens, positions, all_logits)
        finally:
            self.current = None
        made = _graph_count() - before
        rec.compiled_calls += 1
        rec.cudagraph_skips += _cudagraph_skips() - skips
        if first:
            rec.graphs += made
            rec.compile_s = time.perf_counter() - t0
        else:
            rec.recompiles += made
            rec.graphs += made
        # Clone: a CUDA graph's output memory is reused by its next replay.
        return logits.clone() if logits.dtype == torch.float32 else logits.float()

    # ------------------------------------------------------------ the record

    def graphs_compiled(self) -> int:
        return sum(r.graphs for r in self.shapes.values())

    def record(self) -> dict:
        shapes = [asdict(r) for r in self.shapes.values()]
        eager = [s for s in shapes if s["ran"] == "eager"]
        compiled = [s for s in shapes if s["ran"] == "compiled"]
        if not shapes:
            summary = "requested; no step ran"
        elif not eager:
            summary = "compiled"
        elif not compiled:
            summary = "eager"
        else:
            summary = f"partly compiled: {len(eager)} of {len(shapes)} shapes eager"
        return {"requested": True, "ran": summary,
                "backend": self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__",
                                                                                    repr(self.backend)),
                "mode": self.mode, "dynamic": "width" if self.dynamic_width else False,
                # width groups of two or more planned shapes: the graphs really traced with a
                # symbolic width (0: every graph static, whatever `dynamic` allows)
                "dynamic_graphs": sum(1 for g in graph_groups(self.expected, self.dynamic_width).values()
                                      if len(g) > 1),
                "fullgraph": self.fullgraph, "planned_shapes": len(self.expected),
                "planned_graphs": self.max_graphs, "graphs_compiled": self.graphs_compiled(),
                "recompiles": sum(r.recompiles for r in self.shapes.values()),
                "eager_shapes": len(eager), "compiled_shapes": len(compiled),
                "cudagraph_skipped_shapes": sum(1 for r in self.shapes.values() if r.cudagraph_skips),
                "compile_s": round(sum(r.compile_s for r in self.shapes.values()), 3),
                "record_s": round(sum(r.record_s for r in self.shapes.values()), 3),
                "dynamo_settings": dict(self.settings), "torch": torch.__version__, "shapes": shapes}


def step_shapes(label: str, batch: int, cache_len: int, widths, all_logits: bool = False) -> list[tuple]:
    """Keys of the steps a session should compile: one per width, for one model and cache."""
    return [(label, batch, int(w), int(cache_len), bool(all_logits)) for w in widths]


def graph_key(key: tuple, dynamic_width: bool) -> tuple:
    """The graph a shape key (step_shapes) runs in: its own, or its width group's (widths >= 2 of
    one model, batch, cache length and logits kept) when widths are dynamic."""
    label, batch, width, length, all_logits = key
    if dynamic_width and width >= 2:
        return (label, batch, "width>=2", length, all_logits)
    return key


def graph_groups(shapes, dynamic_width: bool) -> dict[tuple, list[tuple]]:
    """graph key -> the shape keys it serves. With dynamic widths a group of one width stays a
    static graph (nothing to share), so the count is the graphs a session compiles for `shapes`."""
    groups: dict[tuple, list[tuple]] = {}
    for key in sorted(set(shapes)):
        groups.setdefault(graph_key(key, dynamic_width), []).append(key)
    return groups


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _is_graph_break(e: Exception) -> bool:
    """A failure of the model's code under dynamo (not of one shape's limit or memory)."""
    exc = getattr(torch._dynamo, "exc", None)
    kinds = tuple(k for k in (getattr(exc, "Unsupported", None), getattr(exc, "UserError", None),
                              getattr(exc, "BackendCompilerFailed", None)) if isinstance(k, type))
    limit = getattr(exc, "FailOnRecompileLimitHit", None)
    if isinstance(limit, type) and isinstance(e, limit):
        return False
    return bool(kinds) and isinstance(e, kinds)


def not_compiled(reason: str) -> dict:
    """The record when no session ran: compile off, or asked for where it cannot run."""
    return {"requested": reason != "off", "ran": "eager", "reason": reason, "graphs_compiled": 0, "recompiles": 0,
            "shapes": []}
