"""python -m pipeline.fleet  (make fleet): build, serve and check every target of params.yaml
`fleet.targets`; exit 0 when every target is ok, 1 when any failed or was unschedulable."""
from __future__ import annotations

import sys

from pipeline.core.params import REPO_ROOT, ParamsError, load_params
from pipeline.fleet.driver import FleetError, run_fleet
from pipeline.fleet.fleet_report import table, write_report
from pipeline.fleet.gather import write_fleet


def main() -> int:
    try:
        params = load_params()
        results = run_fleet(params, REPO_ROOT, say=lambda line: print(line, flush=True))
    except (ParamsError, FleetError) as e:
        print(f"fleet: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fleet: interrupted; remote work cancelled", file=sys.stderr)
        return 130
    doc = write_fleet(REPO_ROOT, results)
    page = write_report(REPO_ROOT, doc)
    print(table(doc))
    print(f"wrote metrics/fleet.json, {page.relative_to(REPO_ROOT)} and fleet/<target>/")
    return 0 if all(t["status"] == "ok" for t in doc["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
