"""A stand-in for dra_driver.allocator.explain until it is merged (deleted then): it allocates
`exactly` requests (and firstAvailable subrequests) by class name -> device type and count only,
first free devices first. Only the CLI's plumbing is tested against it."""

from __future__ import annotations

from typing import Any

TYPES = {"gpu.tessera.dev": "gpu", "mig.gpu.tessera.dev": "mig"}


class FakeCel:
    pass


class FakeExplanation:
    def __init__(self, results: list[dict[str, Any]] | None, reason: str) -> None:
        self.ok = results is not None
        self.gave_up = False
        self._results = results or []
        self._reason = reason

    def allocation(self) -> dict[str, Any]:
        return {"devices": {"results": self._results}}

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "results": self._results, "reason": self._reason or None}

    def text(self) -> str:
        if self.ok:
            return "\n".join(f"{r['request']}: {r['pool']}/{r['device']}" for r in self._results)
        return self._reason

    def first_reason(self) -> str:
        return self._reason


def fake_explain(claim, classes, slices, allocated, *, cel, time_limit_s=10.0, in_use=()):
    taken = {tuple(x) for x in in_use}
    for c in allocated:
        for r in c["status"]["allocation"]["devices"]["results"]:
            taken.add((r["driver"], r["pool"], r["device"]))
    known = {c["metadata"]["name"] for c in classes}
    free = [
        (s["spec"]["driver"], s["spec"]["pool"]["name"], d)
        for s in slices
        for d in s["spec"].get("devices", [])
    ]
    results: list[dict[str, Any]] = []
    for req in claim["spec"]["devices"]["requests"]:
        options = (
            [(f"{req['name']}/{s['name']}", s) for s in req["firstAvailable"]]
            if "firstAvailable" in req
            else [(req["name"], req["exactly"])]
        )
        for name, spec in options:
            if spec["deviceClassName"] not in known:
                return FakeExplanation(None, f"{name}: no DeviceClass {spec['deviceClassName']}")
            want = TYPES.get(spec["deviceClassName"])
            picks = [
                f
                for f in free
                if (f[0], f[1], f[2]["name"]) not in taken
                and f[2].get("attributes", {}).get("type", {}).get("string") == want
            ][: spec.get("count", 1)]
            if len(picks) == spec.get("count", 1):
                for drv, pool, d in picks:
                    taken.add((drv, pool, d["name"]))
                    results.append(
                        {"request": name, "driver": drv, "pool": pool, "device": d["name"]}
                    )
                break
        else:
            return FakeExplanation(None, f"{req['name']}: not enough free devices")
    return FakeExplanation(results, "")
