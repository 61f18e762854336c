"""Role makers from fake environments: the roles they make, and the errors that name the variable."""

import pytest

from recps.errors import ConfigError, PSError
from recps.ps.roles import (
    DEFAULT_SLURM_COORDINATOR_PORT,
    EnvRoleMaker,
    MPIRoleMaker,
    Role,
    SlurmRoleMaker,
    TorchrunRoleMaker,
    UserDefinedRoleMaker,
    detect_role_maker,
    expand_nodelist,
    first_host,
    split_host_port,
)

pytestmark = pytest.mark.timeout(30)

TOKEN = {"RECPS_CLUSTER_TOKEN": "secret"}


def recps_env(**overrides):
    env = {
        "RECPS_ROLE": "worker",
        "RECPS_INDEX": "1",
        "RECPS_NUM_SERVERS": "2",
        "RECPS_NUM_WORKERS": "3",
        "RECPS_COORDINATOR": "127.0.0.1:29600",
        **TOKEN,
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


# ----------------------------------------------------------------------------------------------- Role


def test_role_properties_and_world_rank():
    roles = [Role("server", i, 2, 3, "127.0.0.1:1", token="t") for i in range(2)]
    roles += [Role("worker", j, 2, 3, "127.0.0.1:1", token="t") for j in range(3)]
    assert [r.world_rank for r in roles] == [0, 1, 2, 3, 4]
    assert [r.name for r in roles] == ["server0", "server1", "worker0", "worker1", "worker2"]
    assert [r.is_server for r in roles] == [True, True, False, False, False]
    assert [r.is_worker for r in roles] == [False, False, True, True, True]
    assert {r.world_size for r in roles} == {5}
    assert roles[0].host == "127.0.0.1"


def test_role_repr_hides_the_token():
    role = Role("server", 0, 1, 1, "127.0.0.1:1", token="very-secret")
    assert "very-secret" not in repr(role) and "very-secret" not in str(role)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="boss"), "kind='boss'"),
        (dict(index=2), "index=2 is outside [0, 2)"),
        (dict(index=-1), "index=-1"),
        (dict(num_workers=0), "at least one of each"),
        (dict(coordinator="nohost"), "is not host:port"),
        (dict(coordinator="h:70000"), "outside 1..65535"),
        (dict(token=""), "RECPS_CLUSTER_TOKEN"),
        (dict(server_endpoints=("a:1",)), "1 server endpoints"),
        (dict(server_endpoints=("a:1", "b")), "server endpoint='b'"),
        (dict(index="0"), "index='0' is not an integer"),
    ],
)
def test_role_validation(kwargs, message):
    args = dict(kind="worker", index=0, num_servers=2, num_workers=2, coordinator="127.0.0.1:1", token="t")
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Role(**args)


def test_role_to_env_round_trips_through_env_role_maker():
    role = Role("server", 1, 2, 1, "127.0.0.1:7", "127.0.0.1", "tok", ("127.0.0.1:8", "127.0.0.1:9"))
    env = role.to_env()
    assert env["RECPS_SERVER_ENDPOINTS"] == "127.0.0.1:8,127.0.0.1:9"
    assert EnvRoleMaker(env).role() == role


# ------------------------------------------------------------------------------------- EnvRoleMaker


def test_env_role_maker_reads_every_variable():
    env = recps_env(RECPS_HOST="10.1.2.3", RECPS_SERVER_ENDPOINTS="10.1.2.3:7000, 10.1.2.4:7000")
    assert EnvRoleMaker(env).role() == Role(
        kind="worker",
        index=1,
        num_servers=2,
        num_workers=3,
        coordinator="127.0.0.1:29600",
        host="10.1.2.3",
        token="secret",
        server_endpoints=("10.1.2.3:7000", "10.1.2.4:7000"),
    )


def test_env_role_maker_defaults_host_to_loopback_for_a_loopback_coordinator():
    assert EnvRoleMaker(recps_env(RECPS_COORDINATOR="localhost:5")).role().host == "127.0.0.1"
    assert EnvRoleMaker(recps_env()).role().server_endpoints is None


def test_env_role_maker_reads_os_environ_at_role_time(monkeypatch):
    for key, value in recps_env(RECPS_ROLE="server", RECPS_INDEX="0").items():
        monkeypatch.setenv(key, value)
    maker = EnvRoleMaker()
    monkeypatch.setenv("RECPS_INDEX", "1")
    assert maker.role().name == "server1"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(RECPS_ROLE=None), r"\$RECPS_ROLE is not set; set RECPS_ROLE=server"),
        (dict(RECPS_ROLE="trainer"), r"\$RECPS_ROLE='trainer'; use 'server' or 'worker'"),
        (dict(RECPS_INDEX=None), r"\$RECPS_INDEX is not set; set RECPS_INDEX to this worker's rank in \[0, 3\)"),
        (dict(RECPS_INDEX="x"), r"\$RECPS_INDEX='x' is not an integer"),
        (dict(RECPS_INDEX="3"), r"\$RECPS_INDEX=3 is not below the 3 workers; use 0..2"),
        (dict(RECPS_NUM_SERVERS="0"), r"\$RECPS_NUM_SERVERS=0 is below 1"),
        (dict(RECPS_NUM_WORKERS=None), r"\$RECPS_NUM_WORKERS is not set"),
        (dict(RECPS_COORDINATOR=None), r"\$RECPS_COORDINATOR is not set; set RECPS_COORDINATOR=host:port"),
        (dict(RECPS_COORDINATOR="10.0.0.1"), r"\$RECPS_COORDINATOR='10.0.0.1' is not host:port"),
        (dict(RECPS_CLUSTER_TOKEN=None), r"\$RECPS_CLUSTER_TOKEN is not set; set RECPS_CLUSTER_TOKEN"),
        (dict(RECPS_CLUSTER_TOKEN="  "), r"\$RECPS_CLUSTER_TOKEN is not set"),
        (dict(RECPS_SERVER_ENDPOINTS="a:1,b"), r"\$RECPS_SERVER_ENDPOINTS item='b' is not host:port"),
        (dict(RECPS_SERVER_ENDPOINTS="a:1"), r"1 server endpoints \['a:1'\] for num_servers=2"),
    ],
)
def test_env_role_maker_errors_name_the_variable(overrides, message):
    with pytest.raises(ConfigError, match=message):
        EnvRoleMaker(recps_env(**overrides)).role()


# -------------------------------------------------------------------------------- rank-based makers


def torchrun_env(rank, world_size=4, **extra):
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **TOKEN, **extra}


def mpi_env(rank, world_size=4, flavour="ompi", **extra):
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE") if flavour == "ompi" else ("PMI_RANK", "PMI_SIZE")
    return {names[0]: str(rank), names[1]: str(world_size), "RECPS_COORDINATOR": "127.0.0.1:6000", **TOKEN, **extra}


def slurm_env(rank, world_size=4, **extra):
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world_size), "SLURM_NODELIST": "localhost,node[2-3]", **TOKEN}
    env.update(extra)
    return env


MAKERS = {
    "torchrun": (lambda env, s=None: TorchrunRoleMaker(s, env), torchrun_env, "127.0.0.1:29500"),
    "ompi": (lambda env, s=None: MPIRoleMaker(s, env), mpi_env, "127.0.0.1:6000"),
    "pmi": (lambda env, s=None: MPIRoleMaker(s, env), lambda r, w=4, **e: mpi_env(r, w, "pmi", **e), "127.0.0.1:6000"),
    "slurm": (lambda env, s=None: SlurmRoleMaker(s, env), slurm_env, f"localhost:{DEFAULT_SLURM_COORDINATOR_PORT}"),
}


@pytest.mark.parametrize("maker_name", sorted(MAKERS))
def test_rank_makers_give_the_first_ranks_the_server_role(maker_name):
    make, env_of, coordinator = MAKERS[maker_name]
    roles = [make(env_of(rank, RECPS_NUM_SERVERS="1")).role() for rank in range(4)]
    assert [r.name for r in roles] == ["server0", "worker0", "worker1", "worker2"]
    assert [r.world_rank for r in roles] == [0, 1, 2, 3]
    assert {(r.num_servers, r.num_workers, r.coordinator, r.host, r.token) for r in roles} == {
        (1, 3, coordinator, "127.0.0.1", "secret")
    }


@pytest.mark.parametrize("maker_name", sorted(MAKERS))
def test_rank_makers_take_num_servers_from_the_constructor_over_the_environment(maker_name):
    make, env_of, _ = MAKERS[maker_name]
    role = make(env_of(1, RECPS_NUM_SERVERS="1"), 2).role()
    assert (role.name, role.num_servers, role.num_workers) == ("server1", 2, 2)


@pytest.mark.parametrize("maker_name", sorted(MAKERS))
def test_rank_makers_read_host_and_server_endpoints(maker_name):
    make, env_of, _ = MAKERS[maker_name]
    env = env_of(3, RECPS_NUM_SERVERS="2", RECPS_HOST="10.9.9.9", RECPS_SERVER_ENDPOINTS="10.0.0.1:7,10.0.0.2:7")
    role = make(env).role()
    assert (role.name, role.host, role.server_endpoints) == ("worker1", "10.9.9.9", ("10.0.0.1:7", "10.0.0.2:7"))


@pytest.mark.parametrize("maker_name", sorted(MAKERS))
@pytest.mark.parametrize(
    "change, message",
    [
        ({"RECPS_NUM_SERVERS": None}, r"pass num_servers= to the role maker or set RECPS_NUM_SERVERS"),
        ({"RECPS_NUM_SERVERS": "0"}, r"\$RECPS_NUM_SERVERS=0 is below 1"),
        ({"RECPS_NUM_SERVERS": "4"}, r"=4 with 4 servers leaves no worker"),
        ({"RECPS_CLUSTER_TOKEN": None}, r"\$RECPS_CLUSTER_TOKEN is not set"),
    ],
)
def test_rank_makers_errors(maker_name, change, message):
    make, env_of, _ = MAKERS[maker_name]
    env = env_of(0, RECPS_NUM_SERVERS="1")
    env.update(change)
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        make(env).role()


@pytest.mark.parametrize(
    "maker_name, variable, message",
    [
        ("torchrun", "RANK", r"torchrun variables: \$RANK is not set; start with torchrun"),
        ("torchrun", "WORLD_SIZE", r"\$WORLD_SIZE is not set"),
        ("torchrun", "MASTER_ADDR", r"\$MASTER_ADDR is not set"),
        ("torchrun", "MASTER_PORT", r"\$MASTER_PORT is not set"),
        ("ompi", "OMPI_COMM_WORLD_SIZE", r"MPI variables: \$OMPI_COMM_WORLD_SIZE is not set; start with mpirun"),
        ("pmi", "PMI_SIZE", r"\$PMI_SIZE is not set"),
        ("ompi", "RECPS_COORDINATOR", r"\$RECPS_COORDINATOR is not set; set RECPS_COORDINATOR=host:port on the host of rank 0"),
        ("slurm", "SLURM_NTASKS", r"Slurm variables: \$SLURM_NTASKS is not set; start the tasks with srun"),
        ("slurm", "SLURM_NODELIST", r"none of \$SLURM_STEP_NODELIST, \$SLURM_NODELIST, \$SLURM_JOB_NODELIST is set"),
    ],
)
def test_rank_makers_name_a_missing_variable(maker_name, variable, message):
    make, env_of, _ = MAKERS[maker_name]
    env = env_of(0, RECPS_NUM_SERVERS="1")
    del env[variable]
    with pytest.raises(ConfigError, match=message):
        make(env).role()


def test_rank_beyond_world_size_is_refused():
    with pytest.raises(ConfigError, match=r"\$RANK=4 is not below \$WORLD_SIZE=4"):
        TorchrunRoleMaker(1, torchrun_env(4)).role()
    with pytest.raises(ConfigError, match=r"\$RANK='one' is not an integer"):
        TorchrunRoleMaker(1, torchrun_env("one")).role()
    with pytest.raises(ConfigError, match=r"num_servers=0"):
        TorchrunRoleMaker(0, torchrun_env(0)).role()


def test_torchrun_coordinator_port_steps_aside_from_the_agent_store():
    plain = TorchrunRoleMaker(1, torchrun_env(0)).role()
    agent = TorchrunRoleMaker(1, torchrun_env(0, TORCHELASTIC_USE_AGENT_STORE="True")).role()
    chosen = TorchrunRoleMaker(1, torchrun_env(0, TORCHELASTIC_USE_AGENT_STORE="True", RECPS_COORDINATOR_PORT="4000")).role()
    assert (plain.coordinator, agent.coordinator, chosen.coordinator) == ("127.0.0.1:29500", "127.0.0.1:29501", "127.0.0.1:4000")


def test_a_busy_torchrun_coordinator_port_names_where_it_came_from_and_the_fix():
    """Under torchrun server 0 listens on MASTER_PORT + 1, a port nobody checked: when another socket
    holds it, the error says so and names RECPS_COORDINATOR_PORT, instead of only 'pick another port'."""
    import socket

    from recps.ps.node.join import ServerNode

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        master = held.getsockname()[1] - 1
        role = TorchrunRoleMaker(1, torchrun_env(0, MASTER_PORT=str(master), TORCHELASTIC_USE_AGENT_STORE="True")).role()
        with pytest.raises(PSError, match=rf"MASTER_PORT \+ 1 = {master + 1} .*set \$RECPS_COORDINATOR_PORT to a free port"):
            ServerNode(role, num_threads=1).start()


def test_mpi_prefers_open_mpi_variables_over_pmi():
    env = {**mpi_env(1, 4), "PMI_RANK": "3", "PMI_SIZE": "4", "RECPS_NUM_SERVERS": "1"}
    assert MPIRoleMaker(environ=env).role().name == "worker0"


def test_slurm_coordinator_is_the_first_host_of_the_step():
    env = slurm_env(0, RECPS_NUM_SERVERS="1", SLURM_JOB_NODELIST="n[1-8]", SLURM_STEP_NODELIST="gpu[07-09]", RECPS_HOST="10.0.0.7")
    del env["SLURM_NODELIST"]
    assert SlurmRoleMaker(environ=env).role().coordinator == f"gpu07:{DEFAULT_SLURM_COORDINATOR_PORT}"
    env["RECPS_COORDINATOR_PORT"] = "31000"
    assert SlurmRoleMaker(environ=env).role().coordinator == "gpu07:31000"
    assert SlurmRoleMaker(environ=env, coordinator_port=32000).role().coordinator == "gpu07:32000"
    with pytest.raises(ConfigError, match=r"coordinator_port=0"):
        SlurmRoleMaker(environ=env, coordinator_port=0).role()


# -------------------------------------------------------------------------------- Slurm node lists


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[3-4]", ["rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"]),
        ("gpu[3]", ["gpu3"]),
        ("x[1-2].cluster.org,y", ["x1.cluster.org", "x2.cluster.org", "y"]),
        (" cn[1,3-4] ", ["cn1", "cn3", "cn4"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize(
    "nodelist, message",
    [
        ("", "node list is empty"),
        ("node[1-3", r"'\[' is never closed"),
        ("node1-3]", r"'\]' without '\['"),
        ("node[[1]]", r"nested '\['"),
        ("node[a-b]", r"holds 'a-b'; expected N or N-M"),
        ("node[5-2]", r"range '5-2' runs backwards"),
        ("[1-2]", r"has no host name"),
        ("a,,b", r"item '' has no host name"),
    ],
)
def test_expand_nodelist_errors(nodelist, message):
    with pytest.raises(ConfigError, match=message):
        expand_nodelist(nodelist)


def test_first_host_does_not_expand_the_rest_of_a_huge_list():
    assert first_host("big[000001-999999],other[1-999999]") == "big000001"


# ---------------------------------------------------------------------------------- user-defined


def test_user_defined_role_maker():
    role = UserDefinedRoleMaker(
        "server", 0, 1, 2, "10.0.0.1:29600", "tok", host="10.0.0.1", server_endpoints=["10.0.0.1:7000"]
    ).role()
    assert role == Role("server", 0, 1, 2, "10.0.0.1:29600", "10.0.0.1", "tok", ("10.0.0.1:7000",))
    with pytest.raises(ConfigError, match=r"index=1 is outside \[0, 1\) for 1 servers"):
        UserDefinedRoleMaker("server", 1, 1, 2, "10.0.0.1:29600", "tok")


# ------------------------------------------------------------------------------------------ detect


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RECPS_ROLE": "worker", "RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0"}, EnvRoleMaker),
        ({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0"}, TorchrunRoleMaker),
        ({"RANK": "0", "OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0"}, MPIRoleMaker),  # RANK alone is not torchrun
        ({"OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0"}, MPIRoleMaker),
        ({"PMI_RANK": "0", "SLURM_PROCID": "0"}, MPIRoleMaker),
        ({"SLURM_PROCID": "0"}, SlurmRoleMaker),
        ({"RECPS_ROLE": "", "SLURM_PROCID": "0"}, SlurmRoleMaker),  # empty counts as unset
    ],
)
def test_detect_role_maker_order(env, expected):
    assert type(detect_role_maker(env)) is expected


def test_detect_role_maker_passes_num_servers_and_environ():
    maker = detect_role_maker(torchrun_env(2, 4), num_servers=3)
    assert maker.role().name == "server2"


def test_detect_role_maker_without_a_launcher():
    with pytest.raises(ConfigError, match=r"no launcher found .* start with python -m recps.launch, torchrun, mpirun or srun"):
        detect_role_maker({"HOME": "/root"})


@pytest.mark.parametrize(
    "text, expected",
    [("h:1", ("h", 1)), ("10.0.0.1:65535", ("10.0.0.1", 65535)), ("[fe80::1]:80", ("fe80::1", 80)), (" a.b-c:9 ", ("a.b-c", 9))],
)
def test_split_host_port(text, expected):
    assert split_host_port(text) == expected


@pytest.mark.parametrize("text", ["h", ":1", "h:", "h:0", "::1:80", "h:1:2", "h :1"])
def test_split_host_port_refuses(text):
    with pytest.raises(ConfigError, match=r"coordinator="):
        split_host_port(text, what="coordinator")


def test_default_host_for_a_remote_coordinator_is_a_local_address_or_a_clear_error():
    # The coordinator named by this machine's host name: the route to it starts at one of our addresses.
    import ipaddress
    import socket

    role = EnvRoleMaker(recps_env(RECPS_COORDINATOR=f"{socket.gethostname()}:29600")).role()
    ipaddress.ip_address(role.host)  # an address literal, not a name
    with pytest.raises(ConfigError, match=r"coordinator host 'nowhere.invalid' .*; set RECPS_HOST"):
        EnvRoleMaker(recps_env(RECPS_COORDINATOR="nowhere.invalid:29600")).role()
    assert EnvRoleMaker(recps_env(RECPS_COORDINATOR="nowhere.invalid:29600", RECPS_HOST="10.0.0.9")).role().host == "10.0.0.9"
