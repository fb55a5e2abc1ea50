"""What was live at each rank's memory peak, by the code that allocated it, from `mimo run --memory-snapshot-dir
DIR` (one memory_rank<R>.pickle per rank): set it against `mimo plan`'s terms where the plan and a measured peak
differ.

    python scripts/memory_at_peak.py DIR [--top 40] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

from mimo.core.telemetry.memory_snapshot import peak_report

GIB = 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--json", type=Path, help="write every rank's report here too")
    args = parser.parse_args()
    reports = {}
    for path in sorted(args.directory.glob("memory_rank*.pickle")):
        with path.open("rb") as f:
            snapshot = pickle.load(f)
        device = next((i for i, trace in enumerate(snapshot["device_traces"]) if trace), 0)
        report = reports[path.stem] = peak_report(snapshot, device, args.top)
        print(f"{path.stem}: peak {report['peak_bytes'] / GIB:.2f} GiB ({report['before_recording_bytes'] / GIB:.2f} "
              f"allocated before recording), event {report['peak_event']} of {report['events']}")
        for site in report["sites"]:
            print(f"  {site['bytes'] / GIB:8.3f} GiB {site['blocks']:6d} blocks  {site['site']}")
        print(f"  {report['other_bytes'] / GIB:8.3f} GiB elsewhere")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
