"""Turn measured steps into the benchmark report: phases, robust statistics, speedups, the ideal ratio.

A step's wall time is split into :data:`PHASES`, which sum to it exactly: the forward kinds measured by
:class:`~leangrpo_mcore.bench.probe.ForwardProbe` and the engine's phase timer, with ``other`` the rest
(SDE and log-prob math of the rollout, KL reference forwards during the rollout, bookkeeping). With pipeline
stages, ``bubble`` is the time a stage waits for the others (and transfers), taken out of the forward kinds.

The ideal ratio is the speedup a recompute-free schedule would reach if a step cost only its
policy forwards and backwards: per trajectory Native costs T·F + |S|·(F + B), a Lean schedule T·F + |S|·B (T the
rollout's forwards, T' when the steps after the SDE window are compressed; with K updates per rollout the later
blocks' samples recompute under any schedule, + (K − 1)/K·|S|·F),
with F the time of one sample-forward and B of one sample-step backward, both measured in the same run.
B is read from a schedule whose backward synchronises nothing (:func:`ideal_sources`), so that a
schedule whose coalesced sync beats the baselines' per-backward sync can exceed the ideal ratio.

Speedups are given over three Natives (:func:`baselines`): the **best Native** (the fastest of every Native
variant and layout timed, the loop a user would pick), **Native** on the config's own layout, and the **FSDP2
Native** (sharded over every data-parallel rank, a reduce-scatter after every backward: the paper's baseline).
Throughput per label: samples per second (in all and per device), model TFLOP/s per device from the planner's
FLOP count of the step, and MFU where the device's peak is known (:mod:`leangrpo_mcore.engine.throughput`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

from leangrpo_mcore.bench.probe import ForwardTally

PHASES = ("rollout_nograd_forward", "rollout_grad_forward", "recompute", "backward", "sync", "bubble", "reward",
          "optimizer", "other")
NATIVE_VARIANTS = ("native", "native_coalesced")
"""The benchmark variants that run Native (per-backward and coalesced gradient sync)."""
PHASE_LABELS = {"rollout_nograd_forward": "rollout fwd (no grad)", "rollout_grad_forward": "rollout fwd (grad)",
                "recompute": "recompute", "backward": "backward", "sync": "grad sync", "bubble": "pipeline bubble",
                "reward": "reward", "optimizer": "clip + optimizer", "other": "other"}


@dataclass
class StepSample:
    """One measured step of one schedule."""

    seconds: float
    """Wall-clock time of ``StepEngine.step`` on this rank."""
    phases: dict[str, float]
    """Seconds per :data:`PHASES` entry (they sum to ``seconds``)."""
    cpu_seconds: float = 0.0
    """CPU time this process used during the step (all its threads): unlike wall time, it hardly changes when
    other jobs share the cores, but it leaves out time spent waiting for other ranks."""
    forward_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per forward kind (``ForwardTally``)."""
    forward_rows: dict[str, int] = field(default_factory=dict)
    """Sample-forwards per forward kind."""


def split_phases(seconds: float, timings: dict[str, float], tally: ForwardTally) -> dict[str, float]:
    """The step's :data:`PHASES` from its wall time, the engine's phase totals and the forward tally."""
    phases = {
        "rollout_nograd_forward": tally.seconds["nograd"],
        "rollout_grad_forward": tally.seconds["rollout_grad"],
        "recompute": timings.get("recompute", 0.0),
        "backward": timings.get("backward", 0.0),
        "sync": timings.get("sync", 0.0),
        "bubble": timings.get("bubble", 0.0),
        "reward": timings.get("reward", 0.0) + timings.get("advantage", 0.0),
        "optimizer": timings.get("clip", 0.0) + timings.get("optimizer", 0.0),
    }
    phases["other"] = seconds - sum(phases.values())
    return phases


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles (inclusive method), min, max and mean of ``values``."""
    if not values:
        raise ValueError("no measured steps to summarise")
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values),
            "mean": statistics.fmean(values)}


def schedule_summary(name: str, samples: list[StepSample]) -> dict:
    """Step-time statistics and mean phases of one schedule."""
    phases = {p: statistics.fmean(s.phases[p] for s in samples) for p in PHASES}
    return {
        "schedule": name,
        "step_time_s": {**spread([s.seconds for s in samples]), "values": [s.seconds for s in samples]},
        "cpu_time_s": {**spread([s.cpu_seconds for s in samples]), "values": [s.cpu_seconds for s in samples]},
        "phases_s": phases,
        "steps": [{"time_s": s.seconds, "cpu_s": s.cpu_seconds, "phases_s": s.phases, "forward_s": s.forward_seconds,
                   "forward_rows": s.forward_rows} for s in samples],
    }


def ideal_sources(names: list[str], dp_size: int) -> tuple[Optional[str], Optional[str]]:
    """(schedule whose forwards give F, schedule whose backwards give B).

    F: Native (T no-grad + |S| grad forwards per sample), else the first schedule. B: a backward that
    synchronises nothing — Native at one data-parallel rank, otherwise coalesced Native, Retain or Reweight.
    """
    if not names:
        return None, None
    f_source = "native" if "native" in names else names[0]
    order = ["native", "native_coalesced", "retain", "reweight"] if dp_size == 1 else \
        ["native_coalesced", "retain", "reweight", "native"]
    b_source = next((n for n in order if n in names), names[0])
    return f_source, b_source


def forward_time(samples: list[StepSample]) -> float:
    """F: seconds per sample-forward over every policy forward of ``samples`` (KL reference excluded)."""
    kinds = ("nograd", "rollout_grad", "recompute")
    seconds = sum(s.forward_seconds.get(k, 0.0) for s in samples for k in kinds)
    rows = sum(s.forward_rows.get(k, 0) for s in samples for k in kinds)
    if rows == 0:
        raise ValueError("no policy forwards were measured")
    return seconds / rows


def backward_time(samples: list[StepSample], num_steps: float, steps_per_sample: int) -> float:
    """B: seconds per (sample, selected step) backward; samples counted from the rollout's forwards (``num_steps``:
    the forwards of one rollout, T')."""
    rollout_rows = sum(s.forward_rows.get("nograd", 0) + s.forward_rows.get("rollout_grad", 0) for s in samples)
    units = rollout_rows / num_steps * steps_per_sample
    if units <= 0:
        raise ValueError("no backward units were measured")
    return sum(s.phases["backward"] for s in samples) / units


def ideal_ratio(num_steps: float, steps_per_sample: int, forward_s: float, backward_s: float,
                updates: int = 1) -> float:
    """(T·F + |S|·(F + B)) / (T·F + |S|·B + (K − 1)/K·|S|·F), T the rollout's forwards (T' when the steps after the
    SDE window are compressed), K = ``updates`` per rollout (the later blocks' samples recompute under any
    schedule)."""
    t, s = num_steps, steps_per_sample
    lean = t * forward_s + s * backward_s + (updates - 1) / updates * s * forward_s
    return (t * forward_s + s * (forward_s + backward_s)) / lean


def is_native(label: str) -> bool:
    """Whether benchmark label ``label`` (``VARIANT`` or ``VARIANT@LAYOUT``) runs Native."""
    return label.partition("@")[0] in NATIVE_VARIANTS


def baselines(schedules: dict[str, dict], meta: dict) -> dict:
    """The Natives the speedups are given over: ``best`` (fastest median of every Native label), ``fsdp`` (FSDP2
    over every data-parallel rank with per-backward sync: ``native`` when that is the config's layout or there is
    one data-parallel rank, else ``native@sharded``) and every Native's median; a label is None when not timed."""
    medians = {name: e["step_time_s"]["median"] for name, e in schedules.items() if is_native(name)}
    best = min(medians, key=medians.get) if medians else None
    fsdp = "native" if meta.get("layout", "sharded") in ("sharded", "single") else "native@sharded"
    return {"best": best, "fsdp": fsdp if fsdp in schedules else None, "medians_s": medians}


def throughput(entry: dict, counts: Optional[dict]) -> dict:
    """``samples_per_s``, ``samples_per_s_per_device``, ``tflops_per_device`` and ``mfu`` of a label's median step
    (the trainer's per-step scalars), from its FLOP ``counts`` (:meth:`Bench.throughput`); {} without them."""
    if not counts:
        return {}
    seconds, devices = entry["step_time_s"]["median"], counts["devices"]
    rate = counts["samples_per_step"] / seconds
    out = {"samples_per_s": rate, "samples_per_s_per_device": rate / devices, "tflops_per_device": None,
           "mfu": None, **counts}
    if counts.get("flops_per_step") is not None:
        out["tflops_per_device"] = counts["flops_per_step"] / devices / seconds / 1e12
        if counts.get("peak_tflops"):
            out["mfu"] = out["tflops_per_device"] / counts["peak_tflops"]
    return out


def _speedups(entry: dict, over: Optional[dict], ratio: float, key: str) -> None:
    """``entry[key]`` (wall) and ``entry['cpu_' + key]``: ``over``'s median over the entry's (None without it)."""
    entry[key] = entry[f"cpu_{key}"] = None
    if over is None:
        return
    entry[key] = over["step_time_s"]["median"] / entry["step_time_s"]["median"]
    cpu = entry["cpu_time_s"]["median"]
    if cpu > 0:
        entry[f"cpu_{key}"] = over["cpu_time_s"]["median"] / cpu


def finish_report(report: dict, samples: dict[str, list[StepSample]], counts: Optional[dict] = None) -> dict:
    """Fill ``report['schedules']``, ``report['ideal']`` and ``report['baselines']`` from the measured steps of
    each label (``counts``: per label the FLOP count behind its throughput, :func:`throughput`)."""
    shape = report["shape"]
    names = list(samples)
    schedules = {name: schedule_summary(name, samples[name]) for name in names}
    f_source, b_source = ideal_sources(names, report["meta"]["dp_size"])
    f = forward_time(samples[f_source])
    forwards = shape.get("rollout_steps", shape["num_steps"])
    b = backward_time(samples[b_source], forwards, shape["steps_per_sample"])
    ratio = ideal_ratio(forwards, shape["steps_per_sample"], f, b, shape.get("updates_per_rollout", 1))
    report["ideal"] = {"ratio": ratio, "forward_s": f, "backward_s": b, "forward_source": f_source,
                       "backward_source": b_source}
    chosen = baselines(schedules, report["meta"])
    report["baselines"] = chosen
    for name, entry in schedules.items():
        _speedups(entry, schedules.get("native"), ratio, "speedup")
        _speedups(entry, schedules.get(chosen["best"]), ratio, "speedup_vs_best")
        _speedups(entry, schedules.get(chosen["fsdp"]), ratio, "speedup_vs_fsdp")
        for key in ("speedup", "speedup_vs_best", "cpu_speedup"):
            entry[key.replace("speedup", "fraction_of_ideal")] = None if entry[key] is None else entry[key] / ratio
        entry["throughput"] = throughput(entry, (counts or {}).get(name))
    report["schedules"] = schedules
    return report


# ---------------------------------------------------------------------------------------------- markdown
def _fmt(value: Optional[float], digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _mib(value: Optional[int]) -> str:
    return "–" if value is None else f"{value / 2**20:.1f}"


def _load_note(meta: dict) -> str:
    load = meta.get("load_average") or {}
    if not load.get("start") or not load.get("end"):
        return ""
    start, end = load["start"][0], load["end"][0]
    return f" Load average (1 min) {start:.1f} at the start, {end:.1f} at the end of the timed rounds."


def _cp_note(meta: dict) -> str:
    """", cp N (each sample's tokens split over N ranks)" under context parallelism, else nothing."""
    cp = int(meta.get("cp", 1))
    return f", cp {cp} (each sample's tokens split over {cp} ranks)" if cp > 1 else ""


def _run_header(report: dict) -> list[str]:
    meta, shape = report["meta"], report["shape"]
    params, trained = shape["params"] / 1e6, shape["trainable_params"] / 1e6
    return [f"#### {meta['title']}", "",
            f"world size {meta['world_size']}{_cp_note(meta)} ({meta['device']}, {meta['threads']} threads/rank), "
            f"T={shape['num_steps']}{_forwards_note(shape)}, |S|={shape['steps_per_sample']}, "
            f"{shape['samples_per_rank']} samples/rank, "
            f"{shape['tokens']} tokens, {params:.2f} M params ({trained:.2f} M trained), {meta['steps']} measured "
            f"steps after {meta['warmup']} warm-up, order {', '.join(meta['order'])}.{_gather_note(meta)}"
            f"{_load_note(meta)}", ""]


def _forwards_note(shape: dict) -> str:
    """`` (T'=11 forwards per rollout)`` when the rollout runs fewer forwards than steps, else nothing."""
    forwards = shape.get("rollout_steps", shape["num_steps"])
    return "" if forwards == shape["num_steps"] else f" (T'={forwards:g} forwards per rollout)"


def _gather_note(meta: dict) -> str:
    """The config's own layout's FSDP2 gathering (``parallel.reshard_after_forward`` as the run resolved it)."""
    if meta.get("dp_size", 1) == 1 or "reshard_after_forward" not in meta:
        return ""
    value = meta["reshard_after_forward"]
    return f" Own layout {meta['layout']}, parallel.reshard_after_forward={str(value).lower()}."


def _tflops(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.3g}"


def _time_table(report: dict) -> list[str]:
    layouts = report["meta"].get("layouts", {})
    lines = ["| schedule | layout | median step (s) | IQR (s) | min–max (s) | vs best Native | vs Native | of ideal "
             "| samples/s | TFLOP/s/device | MFU | median CPU (s) | CPU speedup | of ideal (CPU) | peak mem (MiB) "
             "| grad buffers |", "|---" * 16 + "|"]
    for name, entry in report["schedules"].items():
        t, c, rate = entry["step_time_s"], entry["cpu_time_s"], entry.get("throughput") or {}
        mfu = rate.get("mfu")
        lines.append(f"| {name} | {layouts.get(name, '–')} | {t['median']:.3f} "
                     f"| {t['q1']:.3f}–{t['q3']:.3f} | {t['min']:.3f}–{t['max']:.3f} | "
                     f"{_fmt(entry.get('speedup_vs_best'), 2, '×')} | "
                     f"{_fmt(entry['speedup'], 2, '×')} | {_fmt(entry['fraction_of_ideal'], 2)} | "
                     f"{_fmt(rate.get('samples_per_s'), 3)} | {_tflops(rate.get('tflops_per_device'))} | "
                     f"{'–' if mfu is None else f'{100 * mfu:.1f} %'} | {c['median']:.3f} | "
                     f"{_fmt(entry['cpu_speedup'], 2, '×')} | {_fmt(entry['cpu_fraction_of_ideal'], 2)} | "
                     f"{_mib(entry.get('peak_memory_bytes'))} | "
                     f"{entry.get('local_grad_buffers', 0)} |")
    ideal = report["ideal"]
    lines += ["", f"Ideal ratio {ideal['ratio']:.3f} (F = {ideal['forward_s'] * 1e3:.1f} ms per sample-forward from "
              f"{ideal['forward_source']}, B = {ideal['backward_s'] * 1e3:.1f} ms per sample-step backward from "
              f"{ideal['backward_source']}; B/F = {ideal['backward_s'] / ideal['forward_s']:.2f}).",
              _baseline_note(report), ""]
    return lines


def _baseline_note(report: dict) -> str:
    """The sentence naming the best Native and the FSDP2 Native."""
    chosen, schedules = report.get("baselines") or {}, report["schedules"]
    parts = []
    for key, words in (("best", "Best Native"), ("fsdp", "FSDP2 Native (per-backward sync)")):
        label = chosen.get(key)
        if label is not None:
            parts.append(f"{words}: {label} ({schedules[label]['step_time_s']['median']:.3f} s)")
    return "; ".join(parts) + "." if parts else ""


def _speedup_cell(speedup: Optional[float], ratio: float) -> str:
    """``1.49× (1.06)``: a speedup and its fraction of the ideal ratio."""
    return f"{_fmt(speedup, 2, '×')} ({_fmt(None if speedup is None else speedup / ratio, 2)})"


def glance_table(report: dict, name: str = "") -> list[str]:
    """The run's row of BENCHMARKS.md's "at a glance" table, under its header: the best Native (label, seconds),
    each non-Native label's speedup over it (of the ideal ratio), FSDP2 Native's seconds, the speedups over it of
    the other labels on its layout, and the peak memory of those labels."""
    schedules, chosen, layouts = report["schedules"], report.get("baselines") or {}, report["meta"].get("layouts", {})
    best, fsdp = chosen.get("best"), chosen.get("fsdp")
    others = [n for n in schedules if not is_native(n)]
    beside = [n for n in schedules if n != fsdp and layouts.get(n) == layouts.get(fsdp)]
    head = ["run", "ws", "ideal", "best Native", "best Native (s)", *(f"{n} vs best" for n in others),
            "FSDP2 Native (s)", *(f"{n} vs FSDP2" for n in beside),
            "peak MiB " + " / ".join(n for n in schedules if layouts.get(n) == layouts.get(fsdp))]
    cells = [name or report["meta"]["title"], str(report["meta"]["world_size"]), f"{report['ideal']['ratio']:.3f}",
             best or "–", "–" if best is None else f"{schedules[best]['step_time_s']['median']:.3f}"]
    ratio = report["ideal"]["ratio"]
    cells += [_speedup_cell(schedules[n].get("speedup_vs_best"), ratio) for n in others]
    cells.append("–" if fsdp is None else f"{schedules[fsdp]['step_time_s']['median']:.3f}")
    cells += [_speedup_cell(schedules[n].get("speedup_vs_fsdp"), ratio) for n in beside]
    cells.append(" / ".join(_mib(schedules[n].get("peak_memory_bytes")) for n in schedules
                            if layouts.get(n) == layouts.get(fsdp)))
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|", "| " + " | ".join(cells) + " |"]


def _phase_table(report: dict) -> list[str]:
    lines = ["| schedule (mean s) | " + " | ".join(PHASE_LABELS[p] for p in PHASES) + " | step |",
             "|---" * (len(PHASES) + 2) + "|"]
    for name, entry in report["schedules"].items():
        phases = entry["phases_s"]
        lines.append(f"| {name} | " + " | ".join(f"{phases[p]:.3f}" for p in PHASES)
                     + f" | {entry['step_time_s']['mean']:.3f} |")
    return lines


def _prediction_table(report: dict) -> list[str]:
    """The planner's predicted step time of each label against its median wall and CPU time."""
    rows = [(name, entry["predicted"]) for name, entry in report["schedules"].items() if entry.get("predicted")]
    if not rows:
        return []
    kind = rows[0][1].get("hardware", "")
    lines = ["", f"| planner ({kind} rates, reward not modelled) | predicted (s) | measured / predicted "
             "| CPU / predicted |", "|---|---|---|---|"]
    for name, pred in rows:
        seconds, entry = pred.get("step_time_s"), report["schedules"][name]
        wall, cpu = entry["step_time_s"]["median"], entry["cpu_time_s"]["median"]
        lines.append(f"| {name} | {_fmt(seconds, 3)} | {_fmt(None if not seconds else wall / seconds, 2)} "
                     f"| {_fmt(None if not seconds else cpu / seconds, 2)} |")
    return lines


def _parity_table(parity: dict) -> list[str]:
    lines = ["", "| gradient parity vs Native | cosine | rel. L2 | reward max abs diff |", "|---|---|---|---|"]
    for name, row in parity.items():
        lines.append(f"| {name} | {row['cosine']:.6f} | {row['rel_l2']:.2e} "
                     f"| {row['reward_max_abs_diff']:.2e} |")
    return lines


def run_markdown(report: dict) -> str:
    """The Markdown tables of one benchmark run: step times, phases, gradient parity when checked, and the run's
    row of the "at a glance" table."""
    lines = _run_header(report) + _time_table(report) + _phase_table(report) + _prediction_table(report)
    if report.get("parity"):
        lines += _parity_table(report["parity"])
    lines += ["", "At a glance (the row of BENCHMARKS.md's table; in parentheses the fraction of the ideal ratio):",
              ""] + glance_table(report)
    return "\n".join(lines) + "\n"


def sweep_markdown(document: dict) -> str:
    """A summary table over the runs of a sweep (one row per value)."""
    sweep = document["sweep"]
    names = list(document["runs"][0]["schedules"])
    others = [n for n in names if not is_native(n)]
    head = [sweep["key"], "T", r"\|S\|", "tokens", "ideal", "best Native"] + [f"{n} (s)" for n in names] + \
        [f"{n} vs best" for n in others] + [f"{n} speedup" for n in others] + [f"{n} CPU speedup" for n in others] + \
        [f"{n} MiB" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for value, run in zip(sweep["values"], document["runs"]):
        shape, sched = run["shape"], run["schedules"]
        cells = [str(value), str(shape["num_steps"]), str(shape["steps_per_sample"]), str(shape["tokens"]),
                 f"{run['ideal']['ratio']:.3f}", str((run.get("baselines") or {}).get("best") or "–")]
        cells += [f"{sched[n]['step_time_s']['median']:.3f}" for n in names]
        cells += [_fmt(sched[n].get("speedup_vs_best"), 2, "×") for n in others]
        cells += [_fmt(sched[n]["speedup"], 2, "×") for n in others]
        cells += [_fmt(sched[n].get("cpu_speedup"), 2, "×") for n in others]
        cells += [_mib(sched[n].get("peak_memory_bytes")) for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def document_markdown(document: dict) -> str:
    """Markdown of a whole benchmark document (a sweep summary first when there is one)."""
    parts = []
    if document.get("sweep"):
        parts.append(sweep_markdown(document))
    parts += [run_markdown(run) for run in document["runs"]]
    return "\n".join(parts)
