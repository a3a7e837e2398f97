"""Text helpers shared by the commands that report."""

from __future__ import annotations

import math
import sys
from collections import defaultdict


HEARTBEAT_SECONDS = 10


class _Lines:
    """tqdm's output for a stderr that is no terminal (a CI log, ``| tee``, a scheduler): each
    refresh as one whole line, instead of carriage returns that make one endless line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _Silent:
    """The bar of --quiet: counts, prints nothing, and leaves tqdm unimported (40 ms a process)."""

    def __init__(self, total: int):
        self.total, self.n = total, 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _plural(unit: str) -> str:
    """"samples", "ops", "tries"."""
    return unit[:-1] + "ies" if unit.endswith("y") and unit[-2:-1] not in tuple("aeiou") else unit + "s"


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "sample"):
    """A units/s bar on a terminal's stderr; on any other stderr a line every
    ``HEARTBEAT_SECONDS`` with done/total and the time left, the first after that long (short
    steps print nothing); nothing when not ``enabled`` (--quiet)."""
    if not enabled:
        return _Silent(total)
    from tqdm import tqdm

    if sys.stderr.isatty():
        return tqdm(total=total, unit=unit, desc=desc, leave=False)
    return tqdm(total=total, unit=unit, desc=desc, file=_Lines(sys.stderr), mininterval=HEARTBEAT_SECONDS,
                maxinterval=HEARTBEAT_SECONDS, delay=HEARTBEAT_SECONDS, leave=False, ascii=True,
                bar_format="{desc}: {n_fmt}/{total_fmt} " + _plural(unit) + ", {elapsed} elapsed, about {remaining} left")


def finite(x: float):
    """A figure (dB) for JSON: rounded to 3 decimals, or "inf"/"-inf" (JSON has no infinity)."""
    return round(x, 3) if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def float_node_lines(nodes: list[tuple[str, str, str]], indent: str = "  ", shown: int = 3) -> list[str]:
    """Float nodes grouped by (op_type, reason): one line per group with a count and a few names."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for op_type, name, reason in nodes:
        groups[(op_type, reason)].append(name)
    lines = []
    for (op_type, reason), names in groups.items():
        listed = ", ".join(f"'{n}'" for n in names[:shown]) + (", ..." if len(names) > shown else "")
        lines.append(f"{indent}{op_type} x{len(names)}: {reason} ({listed})")
    return lines


def column_width(values, least: int) -> int:
    """A table column as wide as its longest value, at least ``least``: figures stay under their
    headings where names are long (exporters' node and tensor names pass 32 characters)."""
    return max([least, *(len(v) for v in values)])


def int16_summary(ops: list[tuple[str, str]], shown: int = 3) -> str:
    """One line on the integer ops (op_type, node) given int16 activations beside 8-bit ones."""
    counts: dict[str, int] = defaultdict(int)
    for op_type, _ in ops:
        counts[op_type] += 1
    listed = ", ".join(f"'{n}'" for _, n in ops[:shown]) + (", ..." if len(ops) > shown else "")
    return f"{len(ops)} ops ({', '.join(f'{t} {c}' for t, c in counts.items())}) with int16 activations ({listed})"


_CHOICES = {"none": "none", "1.0": "full", "0.5": "half"}


def bias_summary(bc: dict) -> str:
    """One line on a bias correction (``BiasCorrection.to_dict()``): what was fitted, how each
    choice scored on the held-out samples, what was applied."""
    text = f"{bc['ops']} ops fitted on {bc['samples']} samples"
    applied = str(bc["applied"]) if bc["applied"] else "none"
    if bc["ops"] and bc["heldout_samples"]:
        scores = bc["heldout_sqnr_db"]
        shown = ", ".join(f"{_CHOICES.get(k, k)} {v} dB" for k, v in scores.items())
        text += f"; held-out SQNR on {bc['heldout_samples']} other samples: {shown} -> "
        if applied == "none":
            text += "not applied (no correction scores best)"
        else:
            gain = ((scores[applied] - scores["none"]) if all(isinstance(scores[k], float)
                                                               for k in (applied, "none")) else None)
            text += f"applied {_CHOICES[applied]}" + (f" ({gain:+.2f} dB)" if gain is not None else "")
    elif bc["ops"]:
        text += f"; {'applied' if applied != 'none' else 'not applied'}: {bc['not_judged']}"
    if bc["ops"] and applied != "none":
        text += (f" (largest shift {bc['largest_shift']['relative']:.3f} x the output RMS, "
                 f"'{bc['largest_shift']['node']}')")
    if bc.get("fitted_in_rounding"):
        return text + " (fitted for the weight rounding's judge; its time is that step's)"
    return text + f" in {bc['seconds']:.1f} s"


def methods_summary(mc: dict, base: str) -> str:
    """One line on a per-tensor method choice (``MethodChoice.to_dict()``)."""
    changed = ", ".join(f"{m} {n}" for m, n in mc["changed_tensors"].items() if n) or "none"
    text = (f"tensors moved off {base}: {changed}; SQNR {mc['before_sqnr_db']} -> {mc['after_sqnr_db']} dB "
            f"on {mc['samples']} samples")
    if mc.get("heldout_samples"):
        text += (f", held-out {mc['heldout_before_sqnr_db']} -> {mc['heldout_after_sqnr_db']} dB on "
                 f"{mc['heldout_samples']} others" + ("" if mc["kept"] else ": not kept, the table's "
                                                      "own ranges used"))
    return text + f"; {mc['evaluations']} runs in {mc['seconds']:.1f} s"


def pick_summary(mp: dict) -> str:
    """One line on the whole-model method choice (``MethodPick.to_dict()``)."""
    if mp.get("reason"):
        return f"{mp['table_method']} kept ({mp['reason']})"
    if not mp["fit_sqnr_db"]:
        return f"{mp['table_method']} kept (no held-out samples to judge another method on)"
    fit = ", ".join(f"{m} {v}" for m, v in mp["fit_sqnr_db"].items())
    text = f"SQNR on {mp['fit_samples']} fit samples: {fit} dB"
    if not mp["heldout_samples"]:
        return f"{mp['table_method']} kept; {text}"
    best = max(mp["fit_sqnr_db"], key=lambda m: mp["fit_sqnr_db"][m] or -1e9)
    held = (f"held-out {mp['table_method']} {mp['heldout_table_sqnr_db']} -> {best} "
            f"{mp['heldout_chosen_sqnr_db']} dB on {mp['heldout_samples']} others")
    if mp["changed"]:
        ends = mp.get("ends_at_whole_range", 0)
        whole = f", {ends} tensors past the last layer at their whole range" if ends else ""
        return f"{mp['chosen']} chosen (recalibrated on DATA{whole}); {text}; {held}"
    return f"{mp['table_method']} kept; {text}; {held}: not higher"


def placement_summary(pl: dict) -> str:
    """One line on the int16 placement in a transformer (``Placement.to_dict()``)."""
    groups = ", ".join(f"{g} ({n} ops)" for g, n in pl["groups"].items())
    fit = f"SQNR on {pl['fit_samples']} fit samples: int8 {pl['fit_int8_sqnr_db']}"
    if not pl["chosen"]:
        together = ", alone or together," if any(" + " in g for g in (pl["rounds"] or [{}])[-1]) else ""
        return f"none (no group of {groups}{together} gains {pl['gain_db']:g} dB; {fit} dB)"
    chosen = " + ".join(pl["chosen"])
    fit += f" -> {pl['fit_chosen_sqnr_db']} dB with {chosen}"
    if not pl["heldout_samples"]:
        return f"none ({fit}; no held-out samples to judge it on)"
    held = (f"held-out {pl['heldout_int8_sqnr_db']} -> {pl['heldout_chosen_sqnr_db']} dB on "
            f"{pl['heldout_samples']} others")
    if pl["kept"]:  # placed: ops between them (head Reshapes, ...) take int16 too, in the int16 line
        return f"{len(pl['int16'])} ops placed ({chosen}); {fit}; {held}"
    return f"none ({fit}; {held}: not higher)"


def rounding_summary(rp: dict) -> str:
    """One line on the fitted weight rounding (``RoundingPick.to_dict()``)."""
    if rp["reason"]:
        return f"nearest ({rp['reason']})"
    corrected = " after bias correction" if rp.get("after_bias_correction") else ""
    held = (f"held-out nearest {rp['heldout_nearest_sqnr_db']} -> fitted {rp['heldout_fitted_sqnr_db']} dB "
            f"on {rp['heldout_samples']} samples{corrected}")
    kinds = [f"{count} {kind}" for count, kind in ((rp["layers"], "MatMul/Gemm"),
                                                   (rp.get("depthwise", 0), "depthwise Conv"),
                                                   (rp.get("convs", 0), "Conv")) if count]
    what = f"{' and '.join(kinds)} weights fitted to their inputs on {rp['fit_samples']} samples (GPTQ)"
    apart = [f"{count} {text}" for count, text in (
        (rp.get("too_wide", 0), f"of more than {rp.get('max_inputs')} inputs"),
        (rp.get("shared_apart", 0), "whose weight other nodes read in other ways"),
        (rp.get("few_rows", 0), "with fewer rows on the fit samples than inputs")) if count]
    if apart:
        what += f" ({' and '.join(apart)} left nearest)"
    if rp.get("shared_weights"):
        what += (f" ({rp['shared_layers']} of them read {rp['shared_weights']} shared weights, each fitted once "
                 f"on its readers' inputs)")
    if rp.get("heldout_without_convs_sqnr_db") is not None:  # the Convs judged apart
        verdict = "left nearest" if rp["convs_left_nearest"] else "fitted"
        held += (f" (Convs {verdict}: with them {rp['heldout_with_convs_sqnr_db']}, without "
                 f"{rp['heldout_without_convs_sqnr_db']} dB)")
    return f"{what}; {held}" + ("" if rp["kept"] else f": not {rp['gain_db']:g} dB higher, nearest kept")


def channels_summary(cp: dict) -> str:
    """One line on the per-channel scales step (``channels.ChannelPick.to_dict()``)."""
    if cp["reason"]:
        return f"per tensor ({cp['reason']})"
    held = (f"held-out per tensor {cp['heldout_per_tensor_sqnr_db']} -> per channel "
            f"{cp['heldout_per_channel_sqnr_db']} dB on {cp['heldout_samples']} samples")
    what = f"{cp['tensors']} activations measured per channel on {cp['fit_samples']} samples"
    if not cp["kept"]:
        return f"{what}; {held}: not {cp['gain_db']:g} dB higher, per tensor kept"
    return f"{what}; {held}" + ("; kept, measured again on all of DATA" if cp.get("ranges_from_all_samples") else "")


def search_summary(sr: dict) -> str:
    """One line on a mixed-precision search (``SearchResult.to_dict()``)."""
    int16 = sr.get("precision", "float") == "int16"
    picked = sr["int16"] if int16 else sr["kept_float"]
    names = ", ".join(f"'{k['node']}'" for k in picked[:5])
    more = f", and {len(picked) - 5} more" if len(picked) > 5 else ""
    goal = ("" if sr["target_sqnr_db"] is None else
            f", target {sr['target_sqnr_db']:g} dB {'reached' if sr['reached'] else 'NOT reached'}")
    listed = f" ({names}{more})" if names else ""
    what = "given int16 activations" if int16 else "kept float"
    base = f"all {sr.get('activations', 'int8')}"  # the all-integer model the search starts from
    text = (f"{len(picked)} ops {what}{listed}; SQNR {sr['integer_sqnr_db']} dB {base} "
            f"-> {sr['final_sqnr_db']} dB{goal} on {sr['samples']} samples")
    if sr.get("heldout_samples"):
        text += (f"; held-out {sr['heldout_integer_sqnr_db']} -> {sr['heldout_final_sqnr_db']} dB on "
                 f"{sr['heldout_samples']} others" + (f": the ops {what} bought nothing there, {base} "
                                                      "kept" if sr.get("reverted") else ""))
    whole = sr.get("whole_sqnr_db")
    if whole is not None:
        what_all = "int16" if int16 else "float"
        text += (f"; every op {what_all} at once: {whole} dB"
                 + (", below the target: no ranking" if sr["target_sqnr_db"] is not None
                    and not float(whole) >= sr["target_sqnr_db"] else ""))  # "inf"/"-inf" from JSON
    phases = sr.get("phases") or {}
    spent = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items() if v >= 0.05)
    return text + f"; {sr['evaluations']} runs in {sr['seconds']:.1f} s" + (f" ({spent})" if spent else "")
