"""``fshard bench``'s results: every rank's raw figures -> the JSON document, the terminal table
and the plot. Pure functions of the raw figures (no process group), tested without ranks."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from fshard._bench._spec import BenchSpec
from fshard._bench._theory import UnitShapes, collective_theory, persistent_theory

__all__ = ["SCHEMA", "format_table", "summarize", "write_plot"]

SCHEMA = "fshard.bench/1"
MiB = 1 << 20
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile.

    Example:
        >>> from fshard._bench._report import quantile
        >>> quantile([1.0, 2.0, 3.0, 4.0], 0.25)
        1.75
    """
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _theory(name: str, spec: BenchSpec, model: dict[str, Any]) -> dict[str, Any]:
    units = [UnitShapes(fqn, tuple(tuple(s) for s in shapes)) for fqn, shapes in model["unit_shapes"].items()]
    pb = model["param_element_bytes"]
    shard = 1 if name == "ddp" else spec.mesh[-1]
    gather = _DTYPE_BYTES.get(model["param_dtype"] or "", pb)
    reduce = _DTYPE_BYTES.get(model["reduce_dtype"] or "", gather)
    persistent = persistent_theory(units, shard=shard, param_bytes=pb)
    collectives = collective_theory(
        units, impl=name, mesh=spec.mesh, reshard_after_forward=model["reshard_after_forward"],
        param_bytes=pb, gather_bytes=gather, reduce_bytes=reduce,
    )  # fmt: skip
    rows = sum(u.padding_row_numel() for u in units)
    return {
        "persistent": persistent,
        "collectives": collectives,
        # An all-gather / reduce-scatter buffer may hold up to a row of padding per parameter
        # and rank more than the padded theory (implementations align differently).
        "collective_padding_bytes": 0 if name == "ddp" else rows * spec.mesh[-1] * max(gather, reduce),
    }


def summarize(raw: dict[str, Any], spec: BenchSpec) -> dict[str, Any]:
    """The JSON document (schema in ``fshard._bench``'s docstring) from the workers' figures."""
    ranks: list[dict[str, Any]] = raw["ranks"]
    results: dict[str, Any] = {}
    ddp_losses = [r["ddp"]["losses"] for r in ranks] if "ddp" in spec.impls else None
    for name in spec.impls:
        per_rank = [r[name] for r in ranks]
        # A step's time is the slowest rank's (the collectives make them finish together).
        steps = [max(sum(r["phases"][i]) for r in per_rank) for i in range(spec.steps)]
        phase = {
            key: statistics.median(max(r["phases"][i][k] for r in per_rank) for i in range(spec.steps))
            for k, key in enumerate(("forward", "backward", "optimizer"))
        }
        persistent = [r["persistent"] for r in per_rank]
        cuda = [r["cuda_peak_bytes"] for r in per_rank]
        entry: dict[str, Any] = {
            "step_s": {
                "median": statistics.median(steps),
                "p25": quantile(steps, 0.25),
                "p75": quantile(steps, 0.75),
                "all": steps,
            },
            "phase_s": phase,
            "ratio_to_ddp": None,
            "persistent_bytes": {
                "per_rank": persistent,
                "max_rank": max(persistent, key=lambda p: sum(p.values())),
            },
            "peak_live_bytes": {"per_rank": [r["peak_live_bytes"] for r in per_rank]},
            "cuda_peak_allocated_bytes": None if cuda[0] is None else {"per_rank": cuda},
            "collectives": {"per_rank": [r["collectives"] for r in per_rank]},
            "theory": _theory(name, spec, raw["model"]),
            "loss": {
                "final_mean": statistics.fmean(r["losses"][-1] for r in per_rank),
                "max_abs_diff_vs_ddp": None
                if ddp_losses is None
                else max(
                    abs(a - b)
                    for r, ref in zip(per_rank, ddp_losses, strict=True)
                    for a, b in zip(r["losses"], ref, strict=True)
                ),
            },
        }
        results[name] = entry
    if "ddp" in results:
        base = results["ddp"]["step_s"]["median"]
        for entry in results.values():
            entry["ratio_to_ddp"] = entry["step_s"]["median"] / base
    return {
        "schema": SCHEMA,
        "config": {
            **{k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(spec).items()},
            "world": raw["world"],
            "backend": raw["backend"],
            "torch": raw["torch"],
            "fshard": raw["fshard"],
        },
        "model": raw["model"],
        "results": results,
    }


def _mib(n: float) -> str:
    return f"{n / MiB:.2f}"


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}"


def _columns(columns: list[tuple[str, str]], rows: list[list[str]]) -> list[str]:
    widths = [max(len(t), *(len(r[i]) for r in rows)) for i, (t, _) in enumerate(columns)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            f"{c:{a}{w}}" for c, (_, a), w in zip(cells, columns, widths, strict=True)
        ).rstrip()

    return [line([t for t, _ in columns]), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def format_table(doc: dict[str, Any]) -> str:
    """The terminal report of a ``summarize`` document."""
    cfg, model, results = doc["config"], doc["model"], doc["results"]
    mesh = "x".join(map(str, cfg["mesh"]))
    kind = "shard" if len(cfg["mesh"]) == 1 else "replicate x shard"
    units = len(model["units"])
    lines = [
        f"{model['name']} ({model['class']}): {model['params'] / 1e6:.2f}M params, {units} units "
        f"({units - 1} + root), reshard after forward: {model['reshard_after_forward']}"
        + (f", compute {model['param_dtype']}" if model["param_dtype"] else ""),
        f"{cfg['world']} ranks on {cfg['device']}/{cfg['backend']}, mesh {mesh} ({kind}); "
        f"{cfg['steps']} measured steps per implementation, interleaved, after {cfg['warmup']} "
        "warm-up + 1 traced; step = slowest rank, median [p25-p75]",
        "",
    ]
    step_cols = [("impl", "<"), ("step ms", ">"), ("[p25-p75]", ">"), ("x DDP", ">"),
                 ("fwd ms", ">"), ("bwd ms", ">"), ("optim ms", ">"), ("final loss", ">")]  # fmt: skip
    rows = []
    for name, e in results.items():
        s, p = e["step_s"], e["phase_s"]
        ratio = e["ratio_to_ddp"]
        rows.append([
            name, _ms(s["median"]), f"[{_ms(s['p25'])}-{_ms(s['p75'])}]",
            "-" if ratio is None else f"{ratio:.2f}",
            _ms(p["forward"]), _ms(p["backward"]), _ms(p["optimizer"]),
            f"{e['loss']['final_mean']:.4f}",
        ])  # fmt: skip
    lines += [*_columns(step_cols, rows), ""]
    mem_cols = [("impl", "<"), ("persistent MiB", ">"), ("params/grads/optim", ">"),
                ("theory", ">"), ("peak live MiB", ">")]  # fmt: skip
    cuda = any(e["cuda_peak_allocated_bytes"] for e in results.values())
    if cuda:
        mem_cols.append(("cuda peak MiB", ">"))
    rows = []
    for name, e in results.items():
        worst, theory = e["persistent_bytes"]["max_rank"], e["theory"]["persistent"]
        row = [
            name, _mib(sum(worst.values())),
            "/".join(_mib(worst[k]) for k in ("params", "grads", "optim")),
            "/".join(_mib(theory[k]) for k in ("params", "grads", "optim")),
            _mib(max(e["peak_live_bytes"]["per_rank"])),
        ]  # fmt: skip
        if cuda:
            peaks = e["cuda_peak_allocated_bytes"]
            row.append("-" if peaks is None else _mib(max(peaks["per_rank"])))
        rows.append(row)
    lines += [*_columns(mem_cols, rows), ""]
    comm_cols = [("impl", "<"), ("collective", "<"), ("calls", ">"), ("MiB/step", ">"), ("theory MiB", ">")]
    rows = []
    for name, e in results.items():
        measured = e["collectives"]["per_rank"][0]
        theory = e["theory"]["collectives"]
        for kind in sorted(set(measured) | set(theory)):
            m = measured.get(kind, {"calls": 0, "bytes": 0})
            rows.append([
                name, kind, str(m["calls"]), _mib(m["bytes"]),
                _mib(theory[kind]) if kind in theory else "-",
            ])  # fmt: skip
    lines += [*_columns(comm_cols, rows), ""]
    lines.append(
        "persistent: this rank's params/grads/AdamW state from tensor storages (largest rank); "
        "theory: ZeRO, padded shards; peak live: tensor storages alive at once during one step "
        "(dispatch-mode tracker); collectives: one step on rank 0 at the c10d ops, payload = "
        "all-gather output / reduce-scatter input / all-reduce tensor"
    )
    return "\n".join(lines)


def write_plot(doc: dict[str, Any], path: str) -> None:
    """Step time and memory per rank per implementation, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "fshard bench --plot needs matplotlib: pip install 'fshard[plot]'"
        ) from None
    results = doc["results"]
    names = list(results)
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    medians = [1e3 * results[n]["step_s"]["median"] for n in names]
    errors = [
        [1e3 * (results[n]["step_s"]["median"] - results[n]["step_s"]["p25"]) for n in names],
        [1e3 * (results[n]["step_s"]["p75"] - results[n]["step_s"]["median"]) for n in names],
    ]
    ax_time.bar(names, medians, yerr=errors, capsize=4, color="#4878a8")
    ax_time.set_ylabel("step time, ms (median, p25-p75)")
    ax_time.set_title("step time (slowest rank)")
    x = range(len(names))
    persistent = [sum(results[n]["persistent_bytes"]["max_rank"].values()) / MiB for n in names]
    peak = [max(results[n]["peak_live_bytes"]["per_rank"]) / MiB for n in names]
    ax_mem.bar([i - 0.2 for i in x], persistent, width=0.4, label="persistent", color="#6a9f58")
    ax_mem.bar([i + 0.2 for i in x], peak, width=0.4, label="peak live", color="#d1883b")
    ax_mem.set_xticks(list(x), names)
    ax_mem.set_ylabel("MiB per rank")
    ax_mem.set_title("memory per rank")
    ax_mem.set_ylim(0, 1.3 * max(persistent + peak))  # room for the legend above the bars
    ax_mem.legend(frameon=False, ncols=2, loc="upper center")
    cfg, model = doc["config"], doc["model"]
    fig.suptitle(
        f"fshard bench: {model['name']}, {model['params'] / 1e6:.2f}M params, "
        f"mesh {'x'.join(map(str, cfg['mesh']))}, {cfg['device']}/{cfg['backend']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
