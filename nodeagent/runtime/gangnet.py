"""A private network per gang (a rental over several nodes) for the Docker runtime: a VXLAN
overlay between the members' hosts, on the rental's own bridge.

On each member's host the rental's network (nodeagent/runtime/docker.py: a user-defined,
internal bridge with no address of the host on it) gets a fixed subnet, the same on every
member, and a VXLAN device enslaved to its bridge:

- VNI: derived from the rental id (24 bits); subnet: a /24 of 100.64.0.0/10, derived from the
  rental id too, so the members agree without talking to each other. Node rank r's container
  has address .(r + 2) (.1 is the engine's gateway address, given to nobody: the host has no
  address on the bridge).
- underlay: the interface holding this member's fabric address (`GPUMARKET_NODE_ADDR`), UDP
  port 4789, the other members' fabric addresses (`GPUMARKET_GANG_ADDRS`) as unicast flooding
  entries (`bridge fdb append 00:00:00:00:00:00 ... dst PEER`), no learning: frames only ever go
  to the gang's own members.
- filter: VXLAN carries no authentication, so the host only accepts datagrams to port 4789
  that come from one of the gang's members AND carry the gang's VNI (an iptables INPUT rule per
  peer matching the VNI with `u32`); every other datagram to that port is dropped. A host that
  cannot install these rules (no root, no iptables, no u32 match) refuses to start gang
  members: a gang is then never placed half-isolated.

The run's rendezvous variables name fabric addresses (the server knows no other); the
container gets them rewritten to overlay addresses (`overlay_env`), so torchrun, gloo and NCCL
bind and connect inside the gang's network and nowhere else.

Every step is idempotent (the agent keeps no state: a restarted agent makes the same calls and
finds everything in place), and `remove` undoes them; `sweep` removes what a crash left behind.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from nodeagent.runtime.base import PermanentRuntimeError, RetryableRuntimeError

logger = logging.getLogger(__name__)

VXLAN_PORT = 4789
VXLAN_OVERHEAD = 50  # outer IPv4 (20) + UDP (8) + VXLAN (8) + inner Ethernet (14)
VXLAN_PREFIX = "gpv-"  # + the digest of the rental's bridge (gpm-<digest>)
OVERLAY_SPACE = ipaddress.ip_network("100.64.0.0/10")
OVERLAY_PREFIX = 24
FILTER_CHAIN = "GPUMARKET-VXLAN"
RDMA_DIR = "/dev/infiniband"
CONTAINER_IFNAME = "eth0"  # a container's interface on its (only) network
_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Gang:
    """What a member's host needs to know of its gang, from the run's rendezvous variables."""

    rental_id: str
    node_rank: int
    node_addr: str  # this member's fabric address
    peers: tuple[str, ...]  # every member's fabric address, by node rank

    @classmethod
    def of(cls, rental_id: str, env: Mapping[str, str]) -> Gang | None:
        """The gang a run belongs to, or None for a single-node run."""
        try:
            nnodes = int(env.get("NNODES", "1"))
        except ValueError:
            return None
        if nnodes <= 1:
            return None
        addrs = tuple(a.strip() for a in env.get("GPUMARKET_GANG_ADDRS", "").split(",") if a)
        try:
            rank = int(env.get("NODE_RANK", ""))
        except ValueError:
            raise PermanentRuntimeError("a gang member's run has no valid NODE_RANK") from None
        if len(addrs) != nnodes or not 0 <= rank < nnodes:
            raise PermanentRuntimeError(
                f"a gang member's run needs NNODES ({nnodes}) addresses in GPUMARKET_GANG_ADDRS "
                f"and NODE_RANK below it (got {len(addrs)} addresses, rank {rank})"
            )
        if nnodes > 2 ** (32 - OVERLAY_PREFIX) - 3:
            raise PermanentRuntimeError(f"a gang network holds at most 253 nodes, not {nnodes}")
        return cls(
            rental_id=rental_id,
            node_rank=rank,
            node_addr=env.get("GPUMARKET_NODE_ADDR", addrs[rank]) or addrs[rank],
            peers=addrs,
        )

    @property
    def _digest(self) -> bytes:
        return hashlib.sha256(f"gang/{self.rental_id}".encode()).digest()

    @property
    def vni(self) -> int:
        """1 .. 2**24 - 1: the same on every member."""
        return int.from_bytes(self._digest[:3], "big") % (2**24 - 1) + 1

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        count = 2 ** (OVERLAY_PREFIX - OVERLAY_SPACE.prefixlen)
        index = int.from_bytes(self._digest[3:7], "big") % count
        first = int(OVERLAY_SPACE.network_address) + index * 2 ** (32 - OVERLAY_PREFIX)
        return ipaddress.ip_network(f"{ipaddress.ip_address(first)}/{OVERLAY_PREFIX}")

    @property
    def gateway(self) -> str:
        """Reserved by the engine's address management; nobody has it."""
        return str(self.subnet.network_address + 1)

    def address(self, rank: int) -> str:
        """The overlay address of node rank `rank`'s container."""
        return str(self.subnet.network_address + rank + 2)

    def overlay_env(self) -> dict[str, str]:
        """The rendezvous variables with overlay addresses instead of fabric ones."""
        return {
            "MASTER_ADDR": self.address(0),
            "GPUMARKET_NODE_ADDR": self.address(self.node_rank),
            "GPUMARKET_GANG_ADDRS": ",".join(self.address(r) for r in range(len(self.peers))),
        }


def vxlan_name(bridge: str) -> str:
    return VXLAN_PREFIX + bridge.removeprefix("gpm-")


def rdma_devices() -> list[str]:
    """Docker device specs for the host's RDMA devices (NCCL's InfiniBand/RoCE transport)."""
    if not os.path.isdir(RDMA_DIR):
        return []
    return [f"{RDMA_DIR}/{name}:{RDMA_DIR}/{name}:rwm" for name in sorted(os.listdir(RDMA_DIR))]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except FileNotFoundError as exc:
        raise PermanentRuntimeError(f"a gang network needs {argv[0]}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise RetryableRuntimeError(f"{' '.join(argv)} timed out") from exc


def _must(argv: list[str]) -> str:
    done = _run(argv)
    if done.returncode != 0:
        raise PermanentRuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def _resolve(address: str) -> str:
    try:
        return str(ipaddress.IPv4Address(address))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0]
    except OSError as exc:
        raise PermanentRuntimeError(f"gang member address {address!r}: {exc}") from exc


def underlay(address: str) -> tuple[str, int]:
    """The interface holding `address` on this host, and its MTU."""
    links = {link["ifname"]: link for link in json.loads(_must(["ip", "-j", "link", "show"]))}
    for entry in json.loads(_must(["ip", "-j", "-4", "addr", "show"])):
        for info in entry.get("addr_info", []):
            if info.get("local") == address:
                name = entry["ifname"]
                return name, int(links.get(name, entry).get("mtu", 1500))
    raise PermanentRuntimeError(
        f"this member's fabric address {address} is on no interface of this host: the gang "
        "network needs it as the tunnel's source"
    )


def overlay_mtu(gang: Gang) -> int:
    return underlay(_resolve(gang.node_addr))[1] - VXLAN_OVERHEAD


def capable(iptables: str = "iptables") -> bool:
    """Whether this host can build gang networks (what its agent declares at join)."""
    try:
        check_filter_possible(iptables)
    except PermanentRuntimeError:
        return False
    return all(shutil.which(tool) for tool in ("ip", "bridge"))


def check_filter_possible(iptables: str = "iptables") -> None:
    """PermanentRuntimeError saying why this host cannot filter the overlay, if it cannot."""
    if os.geteuid() != 0:
        raise PermanentRuntimeError("a gang network needs the agent to run as root")
    if shutil.which(iptables) is None:
        raise PermanentRuntimeError(f"a gang network needs {iptables} (to filter VXLAN)")


def _vni_match(vni: int) -> list[str]:
    # u32: from the start of the UDP header (IP header length: 0>>22&0x3C), the VXLAN header
    # starts 8 bytes in and its VNI fills bytes 4-6 of it.
    return ["-m", "u32", "--u32", f"0>>22&0x3C@12>>8={vni}"]


def _peer_rules(gang: Gang, bridge: str) -> list[list[str]]:
    own = _resolve(gang.node_addr)
    peers = sorted({_resolve(p) for p in gang.peers} - {own})
    return [
        ["-s", peer, "-p", "udp", "--dport", str(VXLAN_PORT), *_vni_match(gang.vni),
         "-m", "comment", "--comment", f"gpumarket {bridge}", "-j", "ACCEPT"]
        for peer in peers
    ]  # fmt: skip


def _ensure_chain(iptables: str) -> None:
    ipt = [iptables, "-w", "5"]
    if _run([*ipt, "-n", "-L", FILTER_CHAIN]).returncode != 0:
        made = _run([*ipt, "-N", FILTER_CHAIN])
        if made.returncode != 0 and "exists" not in made.stderr:
            raise PermanentRuntimeError(f"cannot create {FILTER_CHAIN}: {made.stderr.strip()}")
    drop = ["-j", "DROP"]
    if _run([*ipt, "-C", FILTER_CHAIN, *drop]).returncode != 0:
        _must([*ipt, "-A", FILTER_CHAIN, *drop])
    jump = ["-p", "udp", "--dport", str(VXLAN_PORT), "-j", FILTER_CHAIN]
    if _run([*ipt, "-C", "INPUT", *jump]).returncode != 0:
        _must([*ipt, "-I", "INPUT", "1", *jump])


def ensure(gang: Gang, bridge: str, *, iptables: str = "iptables") -> None:
    """The gang's VXLAN device on `bridge` (made by the engine), its peers and its filter."""
    check_filter_possible(iptables)
    local = _resolve(gang.node_addr)
    device, mtu = underlay(local)
    # The filter first: the tunnel never accepts anything before it is in place.
    _ensure_chain(iptables)
    ipt = [iptables, "-w", "5"]
    for rule in _peer_rules(gang, bridge):
        if _run([*ipt, "-C", FILTER_CHAIN, *rule]).returncode != 0:
            inserted = _run([*ipt, "-I", FILTER_CHAIN, "1", *rule])
            if inserted.returncode != 0:
                raise PermanentRuntimeError(
                    f"cannot install the gang's VXLAN filter (needs the u32 match): "
                    f"{inserted.stderr.strip()}"
                )
    name = vxlan_name(bridge)
    if _run(["ip", "link", "show", "dev", name]).returncode != 0:
        made = _run(
            ["ip", "link", "add", name, "mtu", str(mtu - VXLAN_OVERHEAD), "type", "vxlan",
             "id", str(gang.vni), "local", local, "dev", device, "dstport", str(VXLAN_PORT),
             "nolearning"]
        )  # fmt: skip
        if made.returncode != 0 and "exists" not in made.stderr:
            # The VNI taken by another gang's device on this host (two rentals hashing alike):
            # the kernel refuses a second device rather than merging the two networks.
            raise PermanentRuntimeError(f"cannot create {name}: {made.stderr.strip()}")
    # No IPv6 on the host's side of the overlay: the host takes no part in it.
    for dev in (name, bridge):
        _run(["sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1"])
    _must(["ip", "link", "set", name, "master", bridge])
    _must(["ip", "link", "set", name, "up"])
    present = _must(["bridge", "fdb", "show", "dev", name])
    for peer in sorted({_resolve(p) for p in gang.peers} - {local}):
        if f"00:00:00:00:00:00 dst {peer} " not in present + " ":
            _must(["bridge", "fdb", "append", "00:00:00:00:00:00", "dev", name, "dst", peer])
    logger.info(
        "gang network ready",
        extra={"rental_id": gang.rental_id, "vni": gang.vni, "subnet": str(gang.subnet),
               "device": name, "underlay": device, "peers": len(gang.peers) - 1},
    )  # fmt: skip


def _filter_rules(iptables: str) -> list[list[str]]:
    """Our per-gang rules as they are listed (`-S`), split into arguments."""
    done = _run([iptables, "-w", "5", "-S", FILTER_CHAIN])
    if done.returncode != 0:
        return []
    return [line.split()[2:] for line in done.stdout.splitlines() if line.startswith("-A ")]


def remove(bridge: str, *, iptables: str = "iptables") -> None:
    """Undo `ensure` for the gang on `bridge` (its device, its filter rules); no error when
    something is already gone."""
    if shutil.which("ip") is None:
        return  # then no gang network could have been made here
    name = vxlan_name(bridge)
    if _run(["ip", "link", "show", "dev", name]).returncode == 0:
        _run(["ip", "link", "del", name])
        logger.info("gang network device removed", extra={"device": name})
    if os.geteuid() != 0 or shutil.which(iptables) is None:
        return
    for rule in _filter_rules(iptables):
        if f"gpumarket {bridge}" in " ".join(rule):
            _delete_rule(iptables, rule)


def _delete_rule(iptables: str, rule: list[str]) -> None:
    # `-S` quotes the comment; as arguments it is one word without the quotes.
    args, words = [], iter(rule)
    for word in words:
        if word.startswith('"'):
            while not word.endswith('"') or word == '"':
                word += " " + next(words)
            word = word.strip('"')
        args.append(word)
    _run([iptables, "-w", "5", "-D", FILTER_CHAIN, *args])


def sweep(live_bridges: set[str], *, iptables: str = "iptables") -> None:
    """Remove the devices and rules of gangs whose bridge is not in `live_bridges` (left by
    a crash between a network's removal and its gang's)."""
    if shutil.which("ip") is None:
        return
    done = _run(["ip", "-j", "link", "show", "type", "vxlan"])
    if done.returncode == 0 and done.stdout.strip():
        for link in json.loads(done.stdout):
            name = link.get("ifname", "")
            bridge = "gpm-" + name.removeprefix(VXLAN_PREFIX)
            if name.startswith(VXLAN_PREFIX) and bridge not in live_bridges:
                remove(bridge, iptables=iptables)
    if os.geteuid() != 0 or shutil.which(iptables) is None:
        return
    for rule in _filter_rules(iptables):
        text = " ".join(rule)
        if "gpumarket gpm-" in text:
            bridge = text.split("gpumarket ", 1)[1].split()[0].strip('"')
            if bridge not in live_bridges:
                _delete_rule(iptables, rule)
