"""Who am I in the cluster: a `Role`, read from the environment by a role maker (below recps.cluster: the nodes and Fleet read it).

A cluster has S servers and W workers. Each process learns its `Role` (kind, index within its
kind, S, W, the coordinator's "host:port", its own host, the cluster token) from one role maker:

    maker                  reads                                                   typical launcher
    EnvRoleMaker           RECPS_ROLE, RECPS_INDEX, RECPS_NUM_SERVERS,             python -m recps.launch
                           RECPS_NUM_WORKERS, RECPS_COORDINATOR, RECPS_HOST?,
                           RECPS_CLUSTER_TOKEN, RECPS_SERVER_ENDPOINTS?
    TorchrunRoleMaker      RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT               torchrun, Kubernetes PyTorchJob
    MPIRoleMaker           OMPI_COMM_WORLD_RANK/SIZE or PMI_RANK/PMI_SIZE           mpirun (Open MPI, MPICH, Intel MPI)
    SlurmRoleMaker         SLURM_PROCID, SLURM_NTASKS, SLURM_(STEP_|JOB_)NODELIST   srun
    UserDefinedRoleMaker   its arguments                                            your own code

Rank-based makers (torchrun, MPI, Slurm) give the first S ranks the server role (S from the
constructor or RECPS_NUM_SERVERS) and the rest the worker role, so rank r < S is server r and
rank r >= S is worker r - S; `Role.world_rank` inverts this. All of them read the token from
RECPS_CLUSTER_TOKEN (required: a cluster never runs without one), an optional RECPS_HOST and
an optional RECPS_SERVER_ENDPOINTS.

The coordinator is hosted by server 0 (rank 0). Its address:
- recps variables and MPI: RECPS_COORDINATOR;
- torchrun: MASTER_ADDR and MASTER_PORT, or MASTER_PORT + 1 when torchrun's agent already
  serves its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True, the default of
  torchrun >= 2.4); RECPS_COORDINATOR_PORT overrides the port;
- Slurm: the first host of the step's node list, port RECPS_COORDINATOR_PORT (default 29600).

`host` (the address a process binds and advertises) is RECPS_HOST when set; else 127.0.0.1
when the coordinator is on loopback (one machine); else the local address of the route to the
coordinator (found without sending a packet). On machines whose host name resolves to a
loopback address (Debian's 127.0.1.1), set RECPS_HOST for a multi-machine cluster.

`detect_role_maker(environ)` picks a maker by the variables present, innermost launcher first:
RECPS_ROLE, then RANK and WORLD_SIZE (torchrun is often started by srun or mpirun, one agent
per node, so its ranks are the per-process ones), then OMPI_COMM_WORLD_RANK or PMI_RANK, then
SLURM_PROCID.

>>> role = UserDefinedRoleMaker("worker", 1, num_servers=2, num_workers=3,
...                             coordinator="127.0.0.1:29600", token="t").role()
>>> role.name, role.world_rank, role.world_size, role.is_worker
('worker1', 3, 5, True)
>>> EnvRoleMaker(role.to_env()).role() == role
True
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from typing import Iterator, Literal, Mapping, Protocol

from recps.errors import ConfigError

__all__ = [
    "Role",
    "RoleMaker",
    "EnvRoleMaker",
    "TorchrunRoleMaker",
    "MPIRoleMaker",
    "SlurmRoleMaker",
    "UserDefinedRoleMaker",
    "detect_role_maker",
    "expand_nodelist",
    "first_host",
    "split_host_port",
    "ROLE_ENV",
    "INDEX_ENV",
    "NUM_SERVERS_ENV",
    "NUM_WORKERS_ENV",
    "COORDINATOR_ENV",
    "COORDINATOR_PORT_ENV",
    "HOST_ENV",
    "TOKEN_ENV",
    "SERVER_ENDPOINTS_ENV",
    "DEFAULT_SLURM_COORDINATOR_PORT",
]

ROLE_ENV = "RECPS_ROLE"
INDEX_ENV = "RECPS_INDEX"
NUM_SERVERS_ENV = "RECPS_NUM_SERVERS"
NUM_WORKERS_ENV = "RECPS_NUM_WORKERS"
COORDINATOR_ENV = "RECPS_COORDINATOR"
COORDINATOR_PORT_ENV = "RECPS_COORDINATOR_PORT"
HOST_ENV = "RECPS_HOST"
TOKEN_ENV = "RECPS_CLUSTER_TOKEN"  # the same name as recps.ps.transport.TOKEN_ENV (siblings do not import each other)
SERVER_ENDPOINTS_ENV = "RECPS_SERVER_ENDPOINTS"

DEFAULT_SLURM_COORDINATOR_PORT = 29600

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
_KINDS = ("server", "worker")


# ---------------------------------------------------------------------------------------------- Role


@dataclass(frozen=True)
class Role:
    """The place of one process in a cluster of `num_servers` servers and `num_workers` workers.

    Attributes:
        kind: "server" or "worker".
        index: rank within its kind, in [0, num_servers) or [0, num_workers).
        num_servers, num_workers: S >= 1 and W >= 1.
        coordinator: "host:port" where the coordinator listens (hosted by server 0).
        host: the address this process binds and advertises.
        token: the cluster token every server checks (never logged: see __repr__).
        server_endpoints: S "host:port" strings when known in advance (server i listens on the
            i-th), else None and the coordinator hands them out.
        coordinator_from: where the coordinator's address came from and how to change it, for the
            error when server 0 cannot listen there ("" when a launcher chose a free port).
    """

    kind: Literal["server", "worker"]
    index: int
    num_servers: int
    num_workers: int
    coordinator: str
    host: str = "127.0.0.1"
    token: str = ""
    server_endpoints: tuple[str, ...] | None = None
    coordinator_from: str = ""

    def __post_init__(self) -> None:
        where = f"role {self.kind}{self.index}"
        if self.kind not in _KINDS:
            raise ConfigError(f"{where}: kind={self.kind!r}; use 'server' or 'worker'")
        for name in ("index", "num_servers", "num_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{where}: {name}={value!r} is not an integer")
        if self.num_servers < 1 or self.num_workers < 1:
            raise ConfigError(
                f"{where}: num_servers={self.num_servers}, num_workers={self.num_workers}; "
                "a parameter-server cluster needs at least one of each"
            )
        count = self.num_servers if self.kind == "server" else self.num_workers
        if not 0 <= self.index < count:
            raise ConfigError(f"{where}: index={self.index} is outside [0, {count}) for {count} {self.kind}s")
        split_host_port(self.coordinator, what=f"{where}: coordinator")
        if not self.host:
            raise ConfigError(f"{where}: host is empty; give the address this process binds, e.g. 127.0.0.1")
        if not self.token:
            raise ConfigError(f"{where}: no cluster token; set {TOKEN_ENV} (the same value on every process)")
        if self.server_endpoints is not None:
            endpoints = tuple(self.server_endpoints)
            object.__setattr__(self, "server_endpoints", endpoints)  # a list given by a user becomes a tuple
            if len(endpoints) != self.num_servers:
                raise ConfigError(
                    f"{where}: {len(endpoints)} server endpoints {list(endpoints)} for num_servers={self.num_servers}; "
                    "give one host:port per server, or none"
                )
            for endpoint in endpoints:
                split_host_port(endpoint, what=f"{where}: server endpoint")

    def __repr__(self) -> str:  # the token stays out of logs
        return (
            f"Role({self.name}, servers={self.num_servers}, workers={self.num_workers}, "
            f"coordinator={self.coordinator}, host={self.host})"
        )

    @property
    def is_server(self) -> bool:
        return self.kind == "server"

    @property
    def is_worker(self) -> bool:
        return self.kind == "worker"

    @property
    def name(self) -> str:
        """"server0", "worker1": for log prefixes and file names."""
        return f"{self.kind}{self.index}"

    @property
    def world_size(self) -> int:
        return self.num_servers + self.num_workers

    @property
    def world_rank(self) -> int:
        """Servers first: server i -> i, worker j -> num_servers + j."""
        return self.index if self.is_server else self.num_servers + self.index

    def to_env(self) -> dict[str, str]:
        """The RECPS_* variables that make `EnvRoleMaker` rebuild this role in another process."""
        env = {
            ROLE_ENV: self.kind,
            INDEX_ENV: str(self.index),
            NUM_SERVERS_ENV: str(self.num_servers),
            NUM_WORKERS_ENV: str(self.num_workers),
            COORDINATOR_ENV: self.coordinator,
            HOST_ENV: self.host,
            TOKEN_ENV: self.token,
        }
        if self.server_endpoints is not None:
            env[SERVER_ENDPOINTS_ENV] = ",".join(self.server_endpoints)
        return env


class RoleMaker(Protocol):
    """Anything with a `role()`; it raises ConfigError naming the missing or invalid variable."""

    def role(self) -> Role: ...


# ------------------------------------------------------------------------------------ small parsers


def split_host_port(text: str, *, what: str = "address") -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; ConfigError naming `what` otherwise.

    >>> split_host_port("10.0.0.5:29600")
    ('10.0.0.5', 29600)
    >>> split_host_port("[::1]:7000")
    ('::1', 7000)
    """
    text = str(text).strip()
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\s\[\]]+):(\d+)", text)
    if match is None:
        raise ConfigError(f"{what}={text!r} is not host:port; write it like 127.0.0.1:29600 or [::1]:29600")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 0 < port < 65536:
        raise ConfigError(f"{what}={text!r}: port {port} is outside 1..65535")
    return host, port


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_top_level(nodelist: str) -> list[str]:
    """Split at commas outside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):  # a node list is short (one string per job), not a hot path
        if char == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"node list {nodelist!r}: nested '[' at position {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list {nodelist!r}: ']' without '[' at position {i}")
        elif char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"node list {nodelist!r}: '[' is never closed")
    items.append(nodelist[start:])
    return items


def _expand_range_set(body: str, nodelist: str) -> list[str]:
    """"01-03,7" -> ["01", "02", "03", "7"]; a range keeps the zero padding of its start."""
    out = []
    for part in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None:
            raise ConfigError(f"node list {nodelist!r}: [{body}] holds {part!r}; expected N or N-M")
        low, high = match.group(1), match.group(2)
        if high is None:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ConfigError(f"node list {nodelist!r}: range {part!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def _expand_item(item: str, nodelist: str) -> Iterator[str]:
    """"n[1-2]-r[3-4]" -> n1-r3, n1-r4, n2-r3, n2-r4 (Slurm's order: the last bracket varies fastest)."""
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        yield item
        return
    prefix, rest = item[: match.start()], item[match.end() :]
    for value in _expand_range_set(match.group(1), nodelist):
        for tail in _expand_item(rest, nodelist):
            yield prefix + value + tail


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm node list, without calling scontrol.

    >>> expand_nodelist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    text = nodelist.strip()
    if not text:
        raise ConfigError("node list is empty; expected something like node[01-04],gpu5")
    hosts = []
    for item in _split_top_level(text):
        item = item.strip()
        if not item or item.startswith("["):
            raise ConfigError(f"node list {nodelist!r}: item {item!r} has no host name")
        hosts.extend(_expand_item(item, nodelist))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (where task 0 of a step runs), without expanding the rest.

    >>> first_host("node[01-04,07],gpu5")
    'node01'
    """
    text = nodelist.strip()
    if not text:
        raise ConfigError("node list is empty; expected something like node[01-04],gpu5")
    item = _split_top_level(text)[0].strip()
    if not item or item.startswith("["):
        raise ConfigError(f"node list {nodelist!r}: item {item!r} has no host name")
    return next(_expand_item(item, nodelist))


# --------------------------------------------------------------------------- reading the environment


class _Env:
    """Typed reads from an environment mapping; errors name the variable, its value and the fix."""

    def __init__(self, environ: Mapping[str, str] | None, source: str):
        self.environ = os.environ if environ is None else environ
        self.source = source  # "recps launch variables", "torchrun", ...

    def get(self, name: str) -> str | None:
        value = self.environ.get(name)
        return None if value is None or value.strip() == "" else value.strip()

    def required(self, name: str, fix: str) -> str:
        value = self.get(name)
        if value is None:
            raise ConfigError(f"{self.source}: ${name} is not set; {fix}")
        return value

    def integer(self, name: str, fix: str, *, minimum: int = 0, value: str | None = None) -> int:
        text = self.required(name, fix) if value is None else value
        try:
            number = int(text)
        except ValueError:
            raise ConfigError(f"{self.source}: ${name}={text!r} is not an integer; {fix}") from None
        if number < minimum:
            raise ConfigError(f"{self.source}: ${name}={number} is below {minimum}; {fix}")
        return number

    def token(self) -> str:
        return self.required(TOKEN_ENV, f"set {TOKEN_ENV} to the same secret on every server and worker")

    def server_endpoints(self) -> tuple[str, ...] | None:
        text = self.get(SERVER_ENDPOINTS_ENV)
        if text is None:
            return None
        endpoints = tuple(part.strip() for part in text.split(",") if part.strip())
        for endpoint in endpoints:
            split_host_port(endpoint, what=f"{self.source}: ${SERVER_ENDPOINTS_ENV} item")
        return endpoints

    def num_servers(self, given: int | None) -> int:
        fix = f"pass num_servers= to the role maker or set {NUM_SERVERS_ENV} (the first S ranks serve)"
        if given is not None:
            if isinstance(given, bool) or not isinstance(given, int) or given < 1:
                raise ConfigError(f"{self.source}: num_servers={given!r}; {fix} with S >= 1")
            return given
        return self.integer(NUM_SERVERS_ENV, fix, minimum=1)

    def host(self, coordinator: str) -> str:
        return self.get(HOST_ENV) or _default_host(split_host_port(coordinator)[0], self.source)


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _default_host(coordinator_host: str, source: str) -> str:
    """127.0.0.1 for a loopback coordinator; else the local address of the route to it.

    Connecting a UDP socket sends nothing; it only asks the kernel which interface it would use.
    """
    if _is_loopback(coordinator_host):
        return "127.0.0.1"
    try:
        family, _, _, _, address = socket.getaddrinfo(coordinator_host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as e:
        raise ConfigError(
            f"{source}: cannot find the local address that reaches coordinator host {coordinator_host!r} ({e}); "
            f"set {HOST_ENV} to this machine's address"
        ) from None


def _rank_role(
    env: _Env, rank: int, world_size: int, num_servers: int, coordinator: str, rank_name: str, size_name: str,
    coordinator_from: str = "",
) -> Role:
    """Role of `rank` when the first `num_servers` ranks serve."""
    if rank >= world_size:
        raise ConfigError(f"{env.source}: ${rank_name}={rank} is not below ${size_name}={world_size}")
    if world_size <= num_servers:
        raise ConfigError(
            f"{env.source}: ${size_name}={world_size} with {num_servers} servers leaves no worker; "
            f"start more processes or lower {NUM_SERVERS_ENV}"
        )
    kind = "server" if rank < num_servers else "worker"
    return Role(
        kind=kind,
        index=rank if kind == "server" else rank - num_servers,
        num_servers=num_servers,
        num_workers=world_size - num_servers,
        coordinator=coordinator,
        host=env.host(coordinator),
        token=env.token(),
        server_endpoints=env.server_endpoints(),
        coordinator_from=coordinator_from,
    )


# ------------------------------------------------------------------------------------------- makers


class EnvRoleMaker:
    """recps' own variables, as `python -m recps.launch` sets them (see the module docstring)."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        self._environ = environ  # None: os.environ at role() time

    def role(self) -> Role:
        env = _Env(self._environ, "recps role variables")
        kind = env.required(ROLE_ENV, f"set {ROLE_ENV}=server or {ROLE_ENV}=worker, or start with python -m recps.launch")
        if kind not in _KINDS:
            raise ConfigError(f"{env.source}: ${ROLE_ENV}={kind!r}; use 'server' or 'worker'")
        num_servers = env.integer(NUM_SERVERS_ENV, f"set {NUM_SERVERS_ENV} to the number of servers (>= 1)", minimum=1)
        num_workers = env.integer(NUM_WORKERS_ENV, f"set {NUM_WORKERS_ENV} to the number of workers (>= 1)", minimum=1)
        count = num_servers if kind == "server" else num_workers
        index = env.integer(INDEX_ENV, f"set {INDEX_ENV} to this {kind}'s rank in [0, {count})")
        if index >= count:
            raise ConfigError(f"{env.source}: ${INDEX_ENV}={index} is not below the {count} {kind}s; use 0..{count - 1}")
        coordinator = env.required(COORDINATOR_ENV, f"set {COORDINATOR_ENV}=host:port where server 0 hosts the coordinator")
        split_host_port(coordinator, what=f"{env.source}: ${COORDINATOR_ENV}")
        return Role(
            kind=kind,
            index=index,
            num_servers=num_servers,
            num_workers=num_workers,
            coordinator=coordinator,
            host=env.host(coordinator),
            token=env.token(),
            server_endpoints=env.server_endpoints(),
        )


class TorchrunRoleMaker:
    """torchrun and Kubernetes PyTorchJob: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the first S ranks serve."""

    def __init__(self, num_servers: int | None = None, environ: Mapping[str, str] | None = None):
        self._num_servers = num_servers
        self._environ = environ

    def role(self) -> Role:
        env = _Env(self._environ, "torchrun variables")
        fix = "start with torchrun (or a PyTorchJob), or use recps.launch / another role maker"
        rank = env.integer("RANK", fix)
        world_size = env.integer("WORLD_SIZE", fix, minimum=1)
        master = env.required("MASTER_ADDR", fix)
        port_text = env.get(COORDINATOR_PORT_ENV)
        if port_text is not None:
            port = env.integer(COORDINATOR_PORT_ENV, "give a free TCP port", minimum=1, value=port_text)
            origin = f"${COORDINATOR_PORT_ENV}={port}; set it to a free port"
        else:
            port = env.integer("MASTER_PORT", fix, minimum=1)
            origin = f"$MASTER_PORT={port}"
            if (env.get("TORCHELASTIC_USE_AGENT_STORE") or "").lower() == "true":
                port += 1  # torchrun's agent serves its own TCPStore on MASTER_PORT
                origin = f"$MASTER_PORT + 1 = {port} (torchrun's agent store holds MASTER_PORT)"
            origin += f"; set ${COORDINATOR_PORT_ENV} to a free port"
        coordinator = _join_host_port(master, port)
        split_host_port(coordinator, what=f"{env.source}: coordinator from MASTER_ADDR/MASTER_PORT")
        return _rank_role(env, rank, world_size, env.num_servers(self._num_servers), coordinator, "RANK", "WORLD_SIZE",
                          coordinator_from=origin)


class MPIRoleMaker:
    """mpirun: OMPI_COMM_WORLD_RANK/SIZE (Open MPI) or PMI_RANK/PMI_SIZE (MPICH, Intel MPI); RECPS_COORDINATOR."""

    def __init__(self, num_servers: int | None = None, environ: Mapping[str, str] | None = None):
        self._num_servers = num_servers
        self._environ = environ

    def role(self) -> Role:
        env = _Env(self._environ, "MPI variables")
        if env.get("OMPI_COMM_WORLD_RANK") is not None:
            rank_name, size_name = "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"
        else:
            rank_name, size_name = "PMI_RANK", "PMI_SIZE"
        fix = "start with mpirun (Open MPI sets OMPI_COMM_WORLD_*, MPICH and Intel MPI set PMI_*)"
        rank = env.integer(rank_name, fix)
        world_size = env.integer(size_name, fix, minimum=1)
        coordinator = env.required(
            COORDINATOR_ENV, f"set {COORDINATOR_ENV}=host:port on the host of rank 0 (mpirun -x {COORDINATOR_ENV}=...)"
        )
        split_host_port(coordinator, what=f"{env.source}: ${COORDINATOR_ENV}")
        return _rank_role(env, rank, world_size, env.num_servers(self._num_servers), coordinator, rank_name, size_name)


class SlurmRoleMaker:
    """srun: SLURM_PROCID, SLURM_NTASKS, a node list; the coordinator is on the list's first host."""

    def __init__(
        self, num_servers: int | None = None, environ: Mapping[str, str] | None = None, coordinator_port: int | None = None
    ):
        self._num_servers = num_servers
        self._environ = environ
        self._port = coordinator_port

    def role(self) -> Role:
        env = _Env(self._environ, "Slurm variables")
        fix = "start the tasks with srun (sbatch alone runs one task)"
        rank = env.integer("SLURM_PROCID", fix)
        world_size = env.integer("SLURM_NTASKS", fix, minimum=1)
        # The step's list comes first: task 0 of the step runs on its first host.
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if nodelist is None:
            raise ConfigError(f"{env.source}: none of $SLURM_STEP_NODELIST, $SLURM_NODELIST, $SLURM_JOB_NODELIST is set; {fix}")
        if self._port is not None:
            port = self._port
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ConfigError(f"{env.source}: coordinator_port={port!r}; give a TCP port in 1..65535")
        else:
            port_text = env.get(COORDINATOR_PORT_ENV)
            port = DEFAULT_SLURM_COORDINATOR_PORT
            if port_text is not None:
                port = env.integer(COORDINATOR_PORT_ENV, "give a free TCP port", minimum=1, value=port_text)
        coordinator = _join_host_port(first_host(nodelist), port)
        split_host_port(coordinator, what=f"{env.source}: coordinator")
        origin = (f"SlurmRoleMaker(coordinator_port={port})" if self._port is not None else
                  f"${COORDINATOR_PORT_ENV}={port}" if env.get(COORDINATOR_PORT_ENV) is not None else
                  f"Slurm's default coordinator port {port}") + f"; set ${COORDINATOR_PORT_ENV} to a free port"
        return _rank_role(env, rank, world_size, env.num_servers(self._num_servers), coordinator, "SLURM_PROCID",
                          "SLURM_NTASKS", coordinator_from=origin)


class UserDefinedRoleMaker:
    """A role given in code, e.g. from your own scheduler. Validated like every other role."""

    def __init__(
        self,
        kind: Literal["server", "worker"],
        index: int,
        num_servers: int,
        num_workers: int,
        coordinator: str,
        token: str,
        host: str = "127.0.0.1",
        server_endpoints: tuple[str, ...] | list[str] | None = None,
    ):
        self._role = Role(
            kind=kind,
            index=index,
            num_servers=num_servers,
            num_workers=num_workers,
            coordinator=coordinator,
            host=host,
            token=token,
            server_endpoints=None if server_endpoints is None else tuple(server_endpoints),
        )

    def role(self) -> Role:
        return self._role


def detect_role_maker(environ: Mapping[str, str] | None = None, *, num_servers: int | None = None) -> RoleMaker:
    """The role maker for the launcher that started this process, innermost first (see the module docstring).

    `num_servers` goes to the rank-based makers (else they read RECPS_NUM_SERVERS).

    >>> type(detect_role_maker({"SLURM_PROCID": "0"})).__name__
    'SlurmRoleMaker'
    """
    env = os.environ if environ is None else environ
    if env.get(ROLE_ENV):
        return EnvRoleMaker(env)
    if env.get("RANK") and env.get("WORLD_SIZE"):
        return TorchrunRoleMaker(num_servers, env)
    if env.get("OMPI_COMM_WORLD_RANK") or env.get("PMI_RANK"):
        return MPIRoleMaker(num_servers, env)
    if env.get("SLURM_PROCID"):
        return SlurmRoleMaker(num_servers, env)
    raise ConfigError(
        f"no launcher found in the environment (none of ${ROLE_ENV}, $RANK+$WORLD_SIZE, $OMPI_COMM_WORLD_RANK, "
        "$PMI_RANK, $SLURM_PROCID is set); start with python -m recps.launch, torchrun, mpirun or srun, "
        "or pass a UserDefinedRoleMaker"
    )
