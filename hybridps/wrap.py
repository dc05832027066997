"""Report lines wrapped to a terminal's width at their field boundaries, never inside a word.

The console's reports (the worker's end-of-run summary, `ps.admin stats`) write a line as
fields joined by two spaces (`steps 1000  loss 0.67 -> 0.53  samples/s 7220`): a line too
wide for the terminal is cut between fields, continuations indented. A field wider than the
line is cut at its single spaces; a word wider than the line (a path, an id) is left whole
on a line of its own rather than split, so it can still be copied.
"""

from __future__ import annotations

import textwrap

FIELD_SEPARATOR = "  "
CONTINUATION = "  "  # the indent of a wrapped line's continuations, after the line's own


def wrap_fields(line: str, width: int | None) -> list[str]:
    """`line` as lines of at most `width` columns (but for a word wider than that), cut
    between its fields, else at its spaces; None: no limit (a file or a pipe)."""
    if width is None or len(line) <= width:
        return [line]
    stripped = line.lstrip(" ")
    lead = line[:len(line) - len(stripped)]
    more = lead + CONTINUATION
    out: list[str] = []
    current = ""
    for field in (f for f in stripped.split(FIELD_SEPARATOR) if f):
        indent = lead if not out and not current else more
        joined = f"{current}{FIELD_SEPARATOR}{field}" if current else field
        if len(indent) + len(joined) <= width:
            current = joined
            continue
        if current:
            out.append((lead if not out else more) + current)
        if len(more) + len(field) <= width:
            current = field
            continue
        pieces = textwrap.wrap(field, width, initial_indent=lead if not out else more,
                               subsequent_indent=more, break_long_words=False,
                               break_on_hyphens=False)
        out += pieces[:-1]
        current = pieces[-1].lstrip(" ") if pieces else ""
    if current:
        out.append((lead if not out else more) + current)
    return out or [line]


def wrap_report(lines: list[str], width: int | None) -> list[str]:
    """Every line of a report through wrap_fields."""
    return [part for line in lines for part in wrap_fields(line, width)]
