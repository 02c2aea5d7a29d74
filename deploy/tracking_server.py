"""A team's MLflow tracking server on one host: PostgreSQL, artifacts proxied by the server, users and passwords.

    export MLFLOW_AUTH_ADMIN_PASSWORD=...            # or --admin-password-file FILE; never a default
    python deploy/tracking_server.py start --dir /srv/ddpipe-mlflow --host 0.0.0.0 --port 5000
    python deploy/tracking_server.py add-user alice --permission EDIT --experiment ddpipe   # password: --password-file
    python deploy/tracking_server.py status --dir /srv/ddpipe-mlflow        # and the search.storage URL
    python deploy/tracking_server.py stop --dir /srv/ddpipe-mlflow

``start`` (``make tracking-server``) makes, in ``--dir``, what is not there yet (nothing twice) and starts it:

- PostgreSQL (Debian's ``postgresql`` package; ``--backend-store-uri`` names an existing server instead): a data
  directory it initialises (owned by the ``postgres`` user when run as root, which PostgreSQL refuses to run as),
  listening on 127.0.0.1 only (unless ``--pg-listen``), with a role ``mlflow`` whose random password is kept in
  ``<dir>/secrets`` (0600) and two databases, ``mlflow`` (runs, models) and ``mlflow_auth`` (users, permissions);
- the search's study database (``ddpipe search``, docs/search.md): a role ``search`` with a random
  password of its own in ``<dir>/secrets/postgres-search-password`` and a database ``search`` owned by it. ``start``
  and ``status`` print the ``search.storage`` URL for params.yaml, without the password, which the search's driver
  and its trainings get from ``PGPASSWORD`` or ``~/.pgpass`` (libpq reads either when a URL has none). Trials on
  other nodes: ``--pg-listen 0.0.0.0`` (PostgreSQL's listen_addresses), and pg_hba.conf then lets the ``search``
  role, and no other, reach its database from ``--pg-clients`` (default ``samenet``: the subnets this host is on)
  with scram-sha-256; the mlflow role connects from this host only;
- ``mlflow server --app-name basic-auth``: every request needs a user and password (401 without), an unknown
  experiment is readable by every user and writable by those given EDIT (``default_permission = READ``), and
  artifacts go through the server to ``--artifacts-destination`` (default ``<dir>/artifacts``), so clients never
  hold the store's credentials or mount. An object store's URL (``s3://ddpipe/mlflow``: the team's bucket, beside the
  DVC remote's ``s3://ddpipe/dvc``) is checked before the server starts (it answers, takes the keys, holds the
  bucket: else an error naming it), its endpoint and keys from the environment or else from the DVC remote on the
  same bucket in this repository (``make remote`` wrote them), handed to the server in its environment only;
  without MLflow's job runner (:data:`NO_JOB_RUNNER`: no ddpipe run asks it for anything), ``--workers`` processes
  answering requests (MLflow's default: 4);
- the admin user, created by MLflow on the first start from ``MLFLOW_AUTH_ADMIN_PASSWORD`` (or the file).

The store's password reaches ``mlflow server`` in its environment (``MLFLOW_BACKEND_STORE_URI``) and the auth
config file (0600), never its command line. ``start --foreground`` runs the server in this process: the form a
service manager wants (docs/tracking.md, "A team's tracking server"). Clients authenticate with MLflow's own
means: ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` or ``~/.mlflow/credentials``.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ddpipe.core.objectstore import Store, StoreError, check, is_store_url
from ddpipe.core.processes import alive, stop_group
from ddpipe.tracking.run_store import redact

# Debian and Ubuntu install each PostgreSQL major version's programs in /usr/lib/postgresql/<major>/bin (15 on Debian
# 12, 17 on Debian 13, 16 on Ubuntu 24.04, several side by side); elsewhere they are on PATH (or pg_config says where)
PG_LIB = Path("/usr/lib/postgresql")
SEARCH, SEARCH_SECRET = "search", "postgres-search-password"  # the search's role and database; its password's file
HBA_MARK = "# ddpipe: the search role from other hosts (deploy/tracking_server.py --pg-listen, --pg-clients)"
PERMISSIONS = ("READ", "EDIT", "MANAGE", "NO_PERMISSIONS")


class ServerError(RuntimeError):
    """Something the operator must fix, said in words (no traceback)."""


# -- PostgreSQL ------------------------------------------------------------------------------------


def pg_bin_dirs() -> dict[int, Path]:
    """The installed PostgreSQL versions' program directories by major version: Debian's and Ubuntu's
    /usr/lib/postgresql/<major>/bin (:data:`PG_LIB`), else the one ``pg_config --bindir`` or PATH's ``initdb`` names
    (its version from ``initdb --version``)."""
    found = {int(d.parent.name): d for d in PG_LIB.glob("*/bin")
             if d.parent.name.isdigit() and (d / "initdb").is_file()}
    if found:
        return found
    pg_config = shutil.which("pg_config")
    bindir = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True).stdout.strip() if pg_config else ""
    initdb = Path(bindir) / "initdb" if bindir and (Path(bindir) / "initdb").is_file() else shutil.which("initdb")
    if not initdb:
        return {}
    # "initdb (PostgreSQL) 16.4"
    said = subprocess.run([str(initdb), "--version"], capture_output=True, text=True).stdout
    major = said.split()[-1].split(".")[0] if said.strip() else ""
    return {int(major) if major.isdigit() else 0: Path(initdb).parent}


def pg_bin_dir(data: Path | None = None) -> Path:
    """The programs of the PostgreSQL that runs ``data``: the major version its PG_VERSION names (a data directory is
    bound to the version that made it), or the newest installed for a new one."""
    dirs = pg_bin_dirs()
    if not dirs:
        raise ServerError(f"PostgreSQL was not found (looked in {PG_LIB}/<version>/bin, pg_config and PATH): install "
                          "Debian's or Ubuntu's postgresql package (apt-get install postgresql), or pass "
                          "--backend-store-uri of an existing server")
    made_by = data / "PG_VERSION" if data is not None else None
    if made_by is None or not made_by.is_file():
        return dirs[max(dirs)]
    major = int(made_by.read_text().strip().split(".")[0])
    if major not in dirs:
        raise ServerError(f"{data} was made by PostgreSQL {major}, which is not installed here (installed: "
                          f"{', '.join(map(str, sorted(dirs)))}): install postgresql-{major}, or upgrade the data "
                          "directory with pg_upgrade")
    return dirs[major]


def _pg_bin(name: str, data: Path | None = None) -> str:
    return str(pg_bin_dir(data) / name)


def _as_owner(cmd: list[str]) -> list[str]:
    """``cmd`` as the user who owns the cluster: ``postgres`` when we are root (PostgreSQL refuses root)."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _run(cmd: list[str], what: str, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise ServerError(f"{what} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc.stdout


def _secret(directory: Path, name: str) -> str:
    """A random secret kept in ``<dir>/secrets/<name>`` (0600), made on first use."""
    path = directory / "secrets" / name
    if not path.is_file():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


def start_postgres(directory: Path, port: int, listen: str = "127.0.0.1", clients: str = "samenet") -> str:
    """Initialise (once) and start the cluster in ``<dir>/postgres``, listening on ``listen``, the search role
    reachable from ``clients`` when that is more than this host; the mlflow role's database URI prefix."""
    hba = search_hba_lines(listen, clients)  # a mistake in --pg-clients: said before anything is made
    data, sockets = directory / "postgres", directory / "postgres-run"  # the socket and the log, owner's
    owner_root = os.geteuid() == 0
    for d in (data, sockets):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        if owner_root:
            shutil.chown(d, "postgres", "postgres")
    if owner_root and subprocess.run(_as_owner(["test", "-w", str(data)])).returncode:
        raise ServerError(f"the postgres user cannot reach {data}: a directory above it is not open to other users "
                          "(PostgreSQL refuses to run as root, so it runs as postgres); choose a --dir under a "
                          "directory others may traverse (chmod o+x), e.g. /srv or /var/lib")
    password = _secret(directory, "postgres-mlflow-password")
    if not (data / "PG_VERSION").is_file():
        print(f"initialising PostgreSQL in {data}", flush=True)
        _run(_as_owner([_pg_bin("initdb", data), "-D", str(data), "--auth-local=peer", "--auth-host=scram-sha-256",
                        "-E", "UTF8", "--locale=C.UTF-8"]), "initdb")
    psql = _as_owner([_pg_bin("psql", data), "-h", str(sockets), "-p", str(port), "-d", "postgres", "-v",
                      "ON_ERROR_STOP=1", "-tA"])
    _start_cluster(data, sockets, port, listen, hba, psql)
    made = _provision(psql, "mlflow", password, ("mlflow", "mlflow_auth"))
    made += _provision(psql, SEARCH, _secret(directory, SEARCH_SECRET), (SEARCH,))
    if made:
        print(f"PostgreSQL: created {', '.join(made)}", flush=True)
    return f"postgresql+psycopg://mlflow:{password}@127.0.0.1:{port}"


def _start_cluster(data: Path, sockets: Path, port: int, listen: str, hba: list[str], psql: list[str]) -> None:
    """Start the cluster listening on ``listen``, with ``hba`` (search_hba_lines) in its pg_hba.conf. One left
    running (``stop --keep-postgres``) keeps the addresses it was started with, so it must listen there already; a
    pg_hba.conf changed under it is reloaded."""
    running = subprocess.run(_as_owner([_pg_bin("pg_ctl", data), "-D", str(data), "status"]), capture_output=True)
    if running.returncode == 0:
        now = _run([*psql, "-c", "SHOW listen_addresses"], "psql").strip()
        if now.replace(" ", "") != listen.replace(" ", ""):
            raise ServerError(f"PostgreSQL in {data} is running, listening on {now!r}, not {listen!r} (--pg-listen); "
                              f"stop it (deploy/tracking_server.py stop --dir {data.parent}) and start again")
    changed = write_search_hba(data, hba)
    if running.returncode:
        _run(_as_owner([_pg_bin("pg_ctl", data), "-D", str(data), "-l", str(sockets / "postgres.log"), "-w", "-t", "60",
                        "-o", f"-p {port} -k {sockets} -c listen_addresses='{listen}'", "start"]),
             f"starting PostgreSQL (its log: {sockets / 'postgres.log'})")
    elif changed:
        _run(_as_owner([_pg_bin("pg_ctl", data), "-D", str(data), "reload"]), "reloading PostgreSQL's pg_hba.conf")


def _provision(psql: list[str], role: str, password: str, databases: tuple[str, ...]) -> list[str]:
    """The LOGIN role ``role`` and ``databases`` owned by it, each created unless there; what was created."""
    made = []
    if _run([*psql, "-c", f"SELECT 1 FROM pg_roles WHERE rolname = '{role}'"], "psql").strip() != "1":
        # the statement through stdin: a password on psql's command line would show in ps
        _run(psql, f"creating the {role} role", input=f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        made.append(f"role {role}")
    for db in databases:
        if _run([*psql, "-c", f"SELECT 1 FROM pg_database WHERE datname = '{db}'"], "psql").strip() != "1":
            _run([*psql, "-c", f"CREATE DATABASE {db} OWNER {role}"], f"creating database {db}")
            made.append(f"database {db}")
    return made


def loopback_only(listen: str) -> bool:
    """Whether PostgreSQL's ``listen_addresses`` value reaches this host only."""
    def loopback(address: str) -> bool:
        try:
            return address == "localhost" or ipaddress.ip_address(address).is_loopback
        except ValueError:  # '*', a host name
            return False

    return all(loopback(a.strip()) for a in listen.split(","))


def search_hba_lines(listen: str, clients: str) -> list[str]:
    """pg_hba.conf's lines that let the search role reach its database from ``clients`` (CIDR networks, or
    PostgreSQL's ``samenet``), with scram-sha-256; none while PostgreSQL listens on this host only. Every other
    role and database stays local: initdb's lines match 127.0.0.1 and ::1 only."""
    if loopback_only(listen):
        return []
    lines = []
    for client in (c.strip() for c in clients.split(",")):
        if client not in ("samenet", "all"):
            try:
                ipaddress.ip_network(client, strict=False)
            except ValueError:
                raise ServerError(f"--pg-clients: {client!r} is not accepted; expected samenet (the subnets this "
                                  "host is on), all, or networks such as 10.1.0.0/16, comma-separated") from None
        lines.append(f"host    {SEARCH}    {SEARCH}    {client}    scram-sha-256")
    return lines


def write_search_hba(data: Path, lines: list[str]) -> bool:
    """``lines`` as the block under HBA_MARK at the end of ``<data>/pg_hba.conf`` (replacing the block an earlier
    start wrote); whether the file changed. Written in place: the file keeps its owner, postgres."""
    path = data / "pg_hba.conf"
    text = path.read_text()
    kept = text.split(f"\n{HBA_MARK}\n", 1)[0].rstrip("\n") + "\n"
    new = kept + (f"\n{HBA_MARK}\n" + "\n".join(lines) + "\n" if lines else "")
    if new == text:
        return False
    path.write_text(new)
    return True


def search_storage(directory: Path, port: int, listen: str) -> str:
    """What to put in params.yaml ``search.storage`` (no password) and where its password goes."""
    outside = [a.strip() for a in listen.split(",") if not loopback_only(a)]  # the address other nodes use
    host = "127.0.0.1" if not outside else socket.gethostname() if outside[0] in ("*", "0.0.0.0", "::") else outside[0]
    secret = directory / "secrets" / SEARCH_SECRET
    return (f"search.storage: postgresql+psycopg://{SEARCH}@{host}:{port}/{SEARCH} (its password, in {secret}: "
            f"PGPASSWORD in the search's environment, or the line {host}:{port}:{SEARCH}:{SEARCH}:<password> in "
            "~/.pgpass, mode 0600, on every node that runs trials)")


def stop_postgres(directory: Path) -> None:
    data = directory / "postgres"
    if (data / "postmaster.pid").is_file():
        _run(_as_owner([_pg_bin("pg_ctl", data), "-D", str(data), "-m", "fast", "-w", "stop"]), "stopping PostgreSQL")
        print("PostgreSQL stopped", flush=True)


# -- mlflow server ----------------------------------------------------------------------------------


def admin_password(args: argparse.Namespace) -> str:
    """From --admin-password-file or MLFLOW_AUTH_ADMIN_PASSWORD: the repository holds no default."""
    if args.admin_password_file:
        return Path(args.admin_password_file).read_text().strip()
    if os.environ.get("MLFLOW_AUTH_ADMIN_PASSWORD"):
        return os.environ["MLFLOW_AUTH_ADMIN_PASSWORD"]
    raise ServerError("no admin password: set MLFLOW_AUTH_ADMIN_PASSWORD or pass --admin-password-file FILE "
                      "(MLflow creates the admin user with it on the first start)")


# A user's checked password is trusted this long by the server process that checked it (MLflow's auth cache), not
# hashed again for each request (werkzeug's scrypt: 85 ms of CPU a request, measured on a Xeon). A password changed,
# or a user removed, keeps working on the other server processes for at most this long.
AUTH_CACHE_TTL_S = 60


def write_auth_config(directory: Path, database_uri: str, admin: str) -> Path:
    """MLflow's basic-auth config (0600: it holds the auth database's password)."""
    path = directory / "secrets" / "basic_auth.ini"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = ("[mlflow]\n"
            "default_permission = READ\n"
            f"database_uri = {database_uri}\n"
            f"admin_username = {admin}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


# What ddpipe's runs never ask of a tracking server: MLflow's job runner (GenAI scorers, trace roll-ups), 8 processes
# more, each importing MLflow. An idle server (sqlite store, 4 workers) from its start to 15 s after it answers,
# measured: 31-35 s of CPU and 2,359 MiB PSS with it, 13 s and 981 MiB without (BENCHMARKS.md, "Tracking"). Where the
# operator's environment sets the variable, theirs wins.
NO_JOB_RUNNER = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def server_command(args: argparse.Namespace, artifacts: str) -> list[str]:
    mlflow = Path(sys.executable).with_name("mlflow")
    return [str(mlflow) if mlflow.is_file() else "mlflow", "server", "--app-name", "basic-auth",
            "--host", args.host, "--port", str(args.port), "--artifacts-destination", artifacts,
            "--allowed-hosts", args.allowed_hosts or "*", *(["--workers", str(args.workers)] if args.workers else [])]


def artifact_store_env(artifacts: str) -> dict[str, str]:
    """The server's environment for an object store's ``--artifacts-destination`` (nothing for a directory), once
    the store answered, took its keys and showed its bucket; a ServerError naming what is wrong, before anything
    starts."""
    if not is_store_url(artifacts):
        return {}
    if importlib.util.find_spec("boto3") is None:  # MLflow's S3 artifact repository: else a 500 on each upload
        raise ServerError(f"--artifacts-destination {artifacts}: boto3 is not installed in {sys.prefix} (make setup)")
    store = Store.for_url(artifacts, (Path.cwd(),))
    try:
        check(store, artifacts, "--artifacts-destination")
    except StoreError as exc:
        raise ServerError(str(exc)) from None
    return store.environment()


def health(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def start(args: argparse.Namespace) -> None:
    directory = Path(args.dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    password = admin_password(args)
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    pid_file = directory / "mlflow-server.pid"
    if pid_file.is_file() and alive(int(pid_file.read_text())):
        raise ServerError(f"a tracking server from {directory} is already running (pid {pid_file.read_text().strip()}, "
                          f"{url}); stop it first: python deploy/tracking_server.py stop --dir {directory}")
    artifacts = args.artifacts_destination or str(directory / "artifacts")
    store_env = artifact_store_env(artifacts)  # an object store that is wrong: said before anything starts
    if args.backend_store_uri:
        backend, auth_db = args.backend_store_uri, args.auth_database_uri or f"sqlite:///{directory / 'auth.db'}"
    else:
        prefix = start_postgres(directory, args.pg_port, args.pg_listen, args.pg_clients)
        print(search_storage(directory, args.pg_port, args.pg_listen), flush=True)
        backend, auth_db = f"{prefix}/mlflow", args.auth_database_uri or f"{prefix}/mlflow_auth"
    env = {**NO_JOB_RUNNER, **os.environ, **store_env, "MLFLOW_BACKEND_STORE_URI": backend,
           "MLFLOW_AUTH_ADMIN_PASSWORD": password,
           # the auth app's CSRF key: one per server directory, kept across restarts (sessions survive them)
           "MLFLOW_FLASK_SERVER_SECRET_KEY": _secret(directory, "flask-secret-key"),
           "MLFLOW_AUTH_CONFIG_PATH": str(write_auth_config(directory, auth_db, args.admin_username))}
    cmd = server_command(args, artifacts)
    if args.foreground:  # a service manager's child: it restarts and stops us
        os.execvpe(cmd[0], cmd, env)
    log = open(directory / "mlflow-server.log", "ab")  # noqa: SIM115 (the server's, for its lifetime)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    pid_file.write_text(str(proc.pid))
    deadline = time.monotonic() + args.wait_s
    while not health(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pid_file.unlink(missing_ok=True)
            tail = (directory / "mlflow-server.log").read_text(errors="replace")[-1500:]
            raise ServerError(f"mlflow server did not come up at {url}; the end of its log "
                              f"({directory / 'mlflow-server.log'}):\n{tail}")
        time.sleep(0.5)
    print(f"MLflow tracking server at {url} (pid {proc.pid}): runs in {redact(backend)}, artifacts in {artifacts} "
          f"(through the server), users in {redact(auth_db)}; log {directory / 'mlflow-server.log'}\n"
          f"clients: export MLFLOW_TRACKING_URI={url} MLFLOW_TRACKING_USERNAME=<user> MLFLOW_TRACKING_PASSWORD=<pw>",
          flush=True)


def stop(args: argparse.Namespace) -> None:
    directory = Path(args.dir).resolve()
    pid_file = directory / "mlflow-server.pid"
    if pid_file.is_file():
        pid = int(pid_file.read_text())
        if stop_group(pid, grace_s=10.0):
            print(f"mlflow server (pid {pid}) stopped", flush=True)
        pid_file.unlink(missing_ok=True)
    if not args.keep_postgres:
        stop_postgres(directory)


def status(args: argparse.Namespace) -> None:
    directory = Path(args.dir).resolve()
    pid_file = directory / "mlflow-server.pid"
    running = pid_file.is_file() and alive(int(pid_file.read_text()))
    print(f"mlflow server: {'running, pid ' + pid_file.read_text().strip() if running else 'not running'}")
    data = directory / "postgres"
    if (data / "PG_VERSION").is_file():
        pg = subprocess.run(_as_owner([_pg_bin("pg_ctl", data), "-D", str(data), "status"]), capture_output=True,
                            text=True)
        print(f"PostgreSQL: {'running' if pg.returncode == 0 else 'not running'}")
        if pg.returncode == 0:  # its port: the 4th line of postmaster.pid; its addresses: its own answer
            port = int((data / "postmaster.pid").read_text().splitlines()[3])
            listen = _run(_as_owner([_pg_bin("psql", data), "-h", str(directory / "postgres-run"), "-p", str(port),
                                     "-d", "postgres", "-tAc", "SHOW listen_addresses"]), "psql").strip()
            print(search_storage(directory, port, listen))
    raise SystemExit(0 if running else 3)


# -- users ----------------------------------------------------------------------------------------


def add_user(args: argparse.Namespace) -> None:
    """Create user ``args.name`` (as the admin: MLFLOW_TRACKING_USERNAME/PASSWORD) and give it ``--permission`` on
    ``--experiment`` (created if missing), through MLflow's own auth client. Its password: --password-file or
    DDPIPE_NEW_USER_PASSWORD (MLflow asks for 12 characters or more)."""
    import mlflow
    from mlflow.server.auth.client import AuthServiceClient

    url = args.uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not (url and os.environ.get("MLFLOW_TRACKING_USERNAME") and os.environ.get("MLFLOW_TRACKING_PASSWORD")):
        raise ServerError("add-user talks to the server as its admin: set MLFLOW_TRACKING_URI (or --uri), "
                          "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
    if args.password_file:
        password = Path(args.password_file).read_text().strip()
    elif os.environ.get("DDPIPE_NEW_USER_PASSWORD"):
        password = os.environ["DDPIPE_NEW_USER_PASSWORD"]
    else:
        raise ServerError("the new user's password: --password-file FILE or DDPIPE_NEW_USER_PASSWORD")
    auth = AuthServiceClient(url)
    try:
        auth.create_user(args.name, password)
        print(f"user {args.name} created", flush=True)
        if args.experiment:
            client = mlflow.MlflowClient(url)
            found = client.get_experiment_by_name(args.experiment)
            exp_id = found.experiment_id if found else client.create_experiment(args.experiment)
            auth.grant_user_permission(args.name, "experiment", exp_id, args.permission)
            print(f"user {args.name}: {args.permission} on experiment {args.experiment!r} ({exp_id})", flush=True)
    except mlflow.exceptions.MlflowException as exc:
        raise ServerError(f"{url} refused: {exc.message}") from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="deploy/tracking_server.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="make what is missing and start PostgreSQL and mlflow server")
    s.add_argument("--dir", default="tracking-server", help="where the server keeps its data (default %(default)s)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=5000)
    s.add_argument("--allowed-hosts", default=None, help="Host headers accepted (mlflow's --allowed-hosts; default *)")
    s.add_argument("--workers", type=int, default=None,
                   help="processes that answer requests (mlflow's --workers; default MLflow's, 4)")
    s.add_argument("--pg-port", type=int, default=5433, help="our PostgreSQL's port (default %(default)s)")
    s.add_argument("--pg-listen", default="127.0.0.1", metavar="ADDRESSES",
                   help="our PostgreSQL's listen_addresses (default %(default)s: this host only); e.g. 0.0.0.0 for "
                        "a search whose trials run on other nodes")
    s.add_argument("--pg-clients", default="samenet", metavar="NETWORKS",
                   help="with --pg-listen beyond this host: where the search role may connect from, e.g. "
                        "10.1.0.0/16,10.2.0.0/16 (default %(default)s: the subnets this host is on)")
    s.add_argument("--backend-store-uri", default=None, help="an existing PostgreSQL's URI instead of our own")
    s.add_argument("--auth-database-uri", default=None, help="where users live (default: our PostgreSQL)")
    s.add_argument("--artifacts-destination", default=None,
                   help="a directory or object store (default: <dir>/artifacts)")
    s.add_argument("--admin-username", default="admin")
    s.add_argument("--admin-password-file", default=None, help="else MLFLOW_AUTH_ADMIN_PASSWORD")
    s.add_argument("--foreground", action="store_true", help="run mlflow server in this process (a service's form)")
    s.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for the server to answer")
    for name, helptext in (("stop", "stop mlflow server and our PostgreSQL"), ("status", "what is running")):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("--dir", default="tracking-server")
        if name == "stop":
            q.add_argument("--keep-postgres", action="store_true")
    u = sub.add_parser("add-user", help="a user, and its permission on an experiment (as the admin)")
    u.add_argument("name")
    u.add_argument("--permission", choices=PERMISSIONS, default="EDIT")
    u.add_argument("--experiment", default=None, help="e.g. ddpipe (mlflow.experiment_name)")
    u.add_argument("--password-file", default=None)
    u.add_argument("--uri", default=None, help="the server (else MLFLOW_TRACKING_URI)")
    args = p.parse_args(argv)
    try:
        {"start": start, "stop": stop, "status": status, "add-user": add_user}[args.command](args)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
