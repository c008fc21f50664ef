"""``python -m tests.reliability.summary``: one table of what each reliability suite did in the
last ``make reliability`` (the records ``tests.reliability.report.add`` wrote)."""

from __future__ import annotations

import sys

from tests.reliability.report import COUNTS, load_all, results_dir


def _details(details: dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(details.items()))


def table(records: list[dict[str, object]]) -> list[str]:
    header = ["suite", *COUNTS, "details"]
    rows = [
        [
            str(r.get("suite", "?")),
            *(str(r.get(c, 0)) for c in COUNTS),
            _details(r.get("details") or {}),  # type: ignore[arg-type]
        ]
        for r in records
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    out = []
    for row in [header, *rows]:
        out.append(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        )
    return out


def main() -> int:
    records = load_all()
    if not records:
        print(f"no reliability records in {results_dir()}: run `make reliability` first")
        return 1
    print(f"\nReliability report ({results_dir()})")
    for line in table(records):
        print(line)
    total = {c: sum(int(r.get(c, 0)) for r in records) for c in COUNTS}
    print("total: " + ", ".join(f"{c} {n}" for c, n in total.items()))
    if total["lost"]:
        print("SOMETHING WAS LOST: see the suites with lost > 0")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
