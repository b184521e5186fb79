"""A stand-in for the NIXL Python API (the calls pdserve.kv.transports.nixl makes, as the anchor script uses them),
for agents living in ONE process: transfers are memmoves between registered host addresses. Every descriptor is
checked against the memory the owning agent registered, so address mistakes in the transport fail loudly."""

import ctypes
import json

_AGENTS: dict[str, "nixl_agent"] = {}
CALLS: list[str] = []  # one entry per posted transfer: its op
PREPS: list[tuple[str, int]] = []  # one entry per prepared descriptor list: (agent name, entries)
XFERS: list[tuple[int, int]] = []  # one entry per prepped transfer: (local indices, remote indices)


class nixl_agent_config:  # noqa: N801 - the real API's name
    def __init__(self, backends=None):
        self.backends = backends or []


class nixl_agent:  # noqa: N801
    def __init__(self, name, config):
        assert "UCX" in config.backends
        self.name = name
        self.regs: list[tuple[int, int, int, str]] = []
        self.remotes: dict[str, list] = {}
        _AGENTS[name] = self

    def register_memory(self, reg_list, mem_type=None):
        assert mem_type in ("DRAM", "VRAM"), mem_type
        for addr, n, dev, _ in reg_list:
            self.regs.append((int(addr), int(n), int(dev), mem_type))
        return ("reg", tuple(tuple(r) for r in reg_list), mem_type)

    def deregister_memory(self, descs):
        for addr, n, dev, _ in descs[1]:
            self.regs.remove((int(addr), int(n), int(dev), descs[2]))

    def get_agent_metadata(self):
        return json.dumps({"name": self.name, "regs": self.regs}).encode()

    def add_remote_agent(self, meta):
        d = json.loads(meta)
        self.remotes[d["name"]] = [tuple(r) for r in d["regs"]]
        return d["name"]

    def remove_remote_agent(self, name):
        self.remotes.pop(name)

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=()):
        regs = self.regs if agent_name == "NIXL_INIT_AGENT" else self.remotes[agent_name]
        rows = [tuple(int(v) for v in row) for row in xfer_list]
        PREPS.append((agent_name, len(rows)))
        for addr, n, dev in rows:
            assert any(r[0] <= addr and addr + n <= r[0] + r[1] and r[2] == dev and r[3] == mem_type for r in regs), \
                f"descriptor ({addr:#x}, {n}, {dev}) outside the memory {agent_name} registered"
        return {"rows": rows}

    def make_prepped_xfer(self, op, lh, lidx, rh, ridx, notif=b"", backends=(), skip_desc_merge=False):
        assert op in ("WRITE", "READ") and len(lidx) == len(ridx)
        assert getattr(lidx, "dtype", None) is None or str(lidx.dtype) == "int32", "indices must be int32"
        XFERS.append((len(lidx), len(ridx)))
        return {"op": op, "pairs": [(lh["rows"][i], rh["rows"][j]) for i, j in zip(lidx, ridx)], "state": "PROC"}

    def transfer(self, h):
        CALLS.append(h["op"])
        return "PROC"  # completes on the first check, so the caller's polling loop runs

    def check_xfer_state(self, h):
        if h["state"] == "PROC":
            for (la, ln, _), (ra, rn, _) in h["pairs"]:
                assert ln == rn
                src, dst = (la, ra) if h["op"] == "WRITE" else (ra, la)
                ctypes.memmove(dst, src, ln)
            h["state"] = "DONE"
        return h["state"]

    def release_xfer_handle(self, h):
        h["state"] = "RELEASED"

    def release_dlist_handle(self, h):
        h["rows"] = None
