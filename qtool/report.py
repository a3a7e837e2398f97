"""Text helpers shared by the commands that report."""

from __future__ import annotations

from collections import defaultdict

from tqdm import tqdm


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "sample") -> tqdm:
    """A units/s bar on stderr; also off when stderr is not a terminal (logs stay clean)."""
    return tqdm(total=total, unit=unit, desc=desc, disable=None if enabled else True, leave=False)


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
