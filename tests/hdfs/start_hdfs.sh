#!/usr/bin/env bash
# Start a one-node Apache Hadoop 2.7.3 HDFS (a NameNode and a DataNode JVM) on 127.0.0.1.
#
#   tests/hdfs/start_hdfs.sh WORK_DIR        stop it with: tests/hdfs/stop_hdfs.sh WORK_DIR
#   tests/hdfs/start_hdfs.sh --prepare       only check Java / Jersey and fill the jar cache
#
# The Hadoop jars come from the PyPI sdist pyspark==2.4.8 (it ships Hadoop 2.7.3's jars):
# it is downloaded once (sha256-checked), the needed jars are kept in
# ${RECPS_CACHE:-~/.cache/recps}/hadoop-2.7.3/ and the sdist is deleted. Jersey 1 (for
# WebHDFS) comes from Debian's libjersey1-{core,server,servlet}-java and libjsr311-api-java,
# Java from openjdk-17-jre-headless (or any java >= 8 on PATH / $JAVA / $JAVA_HOME).
#
# Environment:
#   RECPS_CACHE            cache root (default ~/.cache/recps)
#   RECPS_PYSPARK_SDIST    a pyspark-2.4.8.tar.gz already on disk (used as is, not deleted)
#   RECPS_HDFS_TIMEOUT     seconds to wait for the cluster (default 120)
#   RECPS_HDFS_WATCH_PID   stop the cluster when this process ends (e.g. the test runner)
#   PYTHON                 python3 used for free ports and JSON (default python3)
#
# On success WORK_DIR holds cluster.json and cluster.env (host, ports, pids, logs, url) and
# pids (one "name pid" a line, read by stop_hdfs.sh); cluster.json is also printed on stdout.
# Exit status: 0 up; 3 Java / jars / Jersey cannot be had (the reason on stderr); 1 any
# other failure (the JVMs started are stopped, the log tails are on stderr).
set -euo pipefail

HADOOP_VERSION=2.7.3
SDIST_URL=https://files.pythonhosted.org/packages/13/29/1a5d7c60609dfc8fd79c86965e95ea7e9e181385d839bc43913d277effa2/pyspark-2.4.8.tar.gz
SDIST_SHA256=3a19b71b8dc8dd91ebc943604a05e1ab01bce052456d42937035632d852d78dc
# The jars of pyspark-2.4.8/deps/jars/ a NameNode + DataNode (with WebHDFS) needs.
JARS=(
  hadoop-common-2.7.3.jar hadoop-hdfs-2.7.3.jar hadoop-auth-2.7.3.jar hadoop-annotations-2.7.3.jar
  guava-14.0.1.jar protobuf-java-2.5.0.jar htrace-core-3.1.0-incubating.jar
  jetty-6.1.26.jar jetty-util-6.1.26.jar javax.servlet-api-3.1.0.jar
  netty-all-4.1.47.Final.jar
  commons-cli-1.2.jar commons-codec-1.10.jar commons-collections-3.2.2.jar
  commons-configuration-1.6.jar commons-io-2.4.jar commons-lang-2.6.jar commons-logging-1.1.3.jar
  commons-beanutils-1.9.4.jar commons-digester-1.8.jar commons-math3-3.4.1.jar commons-net-3.1.jar
  commons-compress-1.20.jar
  log4j-1.2.17.jar slf4j-api-1.7.16.jar slf4j-log4j12-1.7.16.jar
  jackson-core-asl-1.9.13.jar jackson-mapper-asl-1.9.13.jar jackson-jaxrs-1.9.13.jar jackson-xc-1.9.13.jar
  xmlenc-0.52.jar jsr305-1.3.9.jar xercesImpl-2.9.1.jar avro-1.8.2.jar paranamer-2.8.jar
  httpclient-4.5.6.jar httpcore-4.4.10.jar gson-2.2.4.jar
  zookeeper-3.4.6.jar curator-framework-2.7.1.jar curator-client-2.7.1.jar curator-recipes-2.7.1.jar
  leveldbjni-all-1.8.jar jaxb-api-2.2.2.jar activation-1.1.1.jar
)
JERSEY_JARS=(jersey1-core.jar jersey1-server.jar jersey1-servlet.jar jsr311-api.jar)
JERSEY_DEBS="libjersey1-core-java libjersey1-server-java libjersey1-servlet-java libjsr311-api-java"

die() { echo "start_hdfs: $*" >&2; exit 1; }
unavailable() { echo "start_hdfs: HDFS unavailable: $*" >&2; exit 3; }

[ $# -eq 1 ] || { echo "usage: $0 WORK_DIR | --prepare" >&2; exit 2; }
PREPARE=0; [ "$1" = --prepare ] && PREPARE=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
TIMEOUT=${RECPS_HDFS_TIMEOUT:-120}
CACHE=${RECPS_CACHE:-$HOME/.cache/recps}
JARDIR=$CACHE/hadoop-$HADOOP_VERSION
if [ $PREPARE = 0 ]; then
  command -v "$PY" >/dev/null || die "no python ($PY) for the port and JSON helpers"
  mkdir -p "$1"
  WORK=$(cd "$1" && pwd)
  [ ! -e "$WORK/pids" ] || die "$WORK/pids exists: a cluster may be running there (tests/hdfs/stop_hdfs.sh $WORK)"
  # A fresh cluster each start: a former cluster's folder (it has .recps-hdfs) is emptied, any
  # other folder must be empty.
  if [ -e "$WORK/.recps-hdfs" ]; then
    rm -rf "$WORK/conf" "$WORK/data" "$WORK/logs" "$WORK/web" "$WORK"/*.pid "$WORK"/cluster.*
  elif [ -n "$(ls -A "$WORK")" ]; then
    die "$WORK is not empty (and not a former start_hdfs.sh folder); give an empty or new folder"
  fi
  touch "$WORK/.recps-hdfs"
fi

# ---- Java ------------------------------------------------------------------------------------
if [ -n "${JAVA:-}" ]; then :
elif [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then JAVA=$JAVA_HOME/bin/java
elif command -v java >/dev/null; then JAVA=$(command -v java)
else unavailable "no java (apt-get install openjdk-17-jre-headless, or set JAVA / JAVA_HOME)"
fi
JAVA_SPEC=$(timeout 30 "$JAVA" -XshowSettings:properties -version 2>&1 \
  | sed -n 's/^ *java\.specification\.version = //p') || true
[ -n "$JAVA_SPEC" ] || unavailable "$JAVA does not run (java -version failed)"
JAVA_MAJOR=${JAVA_SPEC#1.}; JAVA_MAJOR=${JAVA_MAJOR%%.*}
[ "$JAVA_MAJOR" -ge 8 ] || unavailable "java $JAVA_SPEC is older than 8"

# ---- Jersey 1 (WebHDFS) from Debian ---------------------------------------------------------
JERSEY_DIR=${RECPS_JERSEY_DIR:-/usr/share/java}
for j in "${JERSEY_JARS[@]}"; do
  [ -r "$JERSEY_DIR/$j" ] || unavailable "no $JERSEY_DIR/$j (apt-get install $JERSEY_DEBS)"
done

# ---- Hadoop jars (cached outside the repo) --------------------------------------------------
jars_ready() {
  [ -f "$JARDIR/.complete" ] || return 1
  local j; for j in "${JARS[@]}"; do [ -s "$JARDIR/$j" ] || return 1; done
}
fetch_jars() {
  local sdist tmp
  tmp=$(mktemp -d "$CACHE/.hadoop-fetch.XXXXXX")
  if [ -n "${RECPS_PYSPARK_SDIST:-}" ]; then
    sdist=$RECPS_PYSPARK_SDIST
    [ -r "$sdist" ] || { rm -rf "$tmp"; unavailable "RECPS_PYSPARK_SDIST=$sdist is not readable"; }
  else
    sdist=$tmp/pyspark-2.4.8.tar.gz
    echo "start_hdfs: downloading pyspark-2.4.8.tar.gz (220 MB, Hadoop $HADOOP_VERSION's jars) ..." >&2
    command -v curl >/dev/null || { rm -rf "$tmp"; unavailable "no curl to download $SDIST_URL"; }
    curl -fsSL --retry 3 --connect-timeout 20 --max-time 480 -o "$sdist" "$SDIST_URL" \
      || { rm -rf "$tmp"; unavailable "download failed: $SDIST_URL"; }
  fi
  echo "$SDIST_SHA256  $sdist" | sha256sum -c --quiet - >/dev/null 2>&1 \
    || { rm -rf "$tmp"; unavailable "sha256 of $sdist is not $SDIST_SHA256"; }
  local members=() j
  for j in "${JARS[@]}"; do members+=("pyspark-2.4.8/deps/jars/$j"); done
  tar -xzf "$sdist" -C "$tmp" "${members[@]}" || { rm -rf "$tmp"; die "cannot extract the jars from $sdist"; }
  rm -rf "$JARDIR.new" && mv "$tmp/pyspark-2.4.8/deps/jars" "$JARDIR.new"
  printf '%s\n' "${JARS[@]}" > "$JARDIR.new/.complete"
  rm -rf "$JARDIR" && mv "$JARDIR.new" "$JARDIR"
  rm -rf "$tmp"
}
mkdir -p "$CACHE"
if ! jars_ready; then
  # One fetch at a time per cache (parallel test runs); flock is util-linux, optional.
  exec 9>"$CACHE/.hadoop-$HADOOP_VERSION.lock"
  if command -v flock >/dev/null; then
    flock -w 540 9 || die "timed out waiting for $CACHE/.hadoop-$HADOOP_VERSION.lock"
  fi
  jars_ready || fetch_jars
  exec 9>&-
fi
if [ $PREPARE = 1 ]; then
  echo "start_hdfs: ready: $JAVA (java $JAVA_SPEC), $JARDIR, Jersey in $JERSEY_DIR" >&2
  exit 0
fi

# ---- configuration ---------------------------------------------------------------------------
read -r RPC NN_HTTP DN_DATA DN_HTTP DN_IPC < <("$PY" - <<'EOF'
import socket
socks = []
for _ in range(5):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(*(s.getsockname()[1] for s in socks))
EOF
)
H=127.0.0.1
CONF=$WORK/conf; LOGS=$WORK/logs; DATA=$WORK/data
mkdir -p "$CONF" "$LOGS" "$DATA/name" "$DATA/data" "$WORK/web/webapps/hdfs" "$WORK/web/webapps/datanode" "$WORK/web/webapps/secondary"
prop() { printf '  <property><name>%s</name><value>%s</value></property>\n' "$1" "$2"; }
{
  echo '<?xml version="1.0"?><configuration>'
  prop fs.defaultFS "hdfs://$H:$RPC"
  prop hadoop.tmp.dir "$DATA/tmp"
  prop hadoop.security.authentication simple
  echo '</configuration>'
} > "$CONF/core-site.xml"
{
  echo '<?xml version="1.0"?><configuration>'
  prop dfs.namenode.name.dir "file://$DATA/name"
  prop dfs.datanode.data.dir "file://$DATA/data"
  prop dfs.namenode.rpc-address "$H:$RPC"
  prop dfs.namenode.rpc-bind-host "$H"
  prop dfs.namenode.http-address "$H:$NN_HTTP"
  prop dfs.namenode.http-bind-host "$H"
  prop dfs.namenode.https-address "$H:0"
  prop dfs.namenode.secondary.http-address "$H:0"
  prop dfs.namenode.secondary.https-address "$H:0"
  prop dfs.namenode.backup.address "$H:0"
  prop dfs.namenode.backup.http-address "$H:0"
  prop dfs.datanode.address "$H:$DN_DATA"
  prop dfs.datanode.http.address "$H:$DN_HTTP"
  prop dfs.datanode.https.address "$H:0"
  prop dfs.datanode.ipc.address "$H:$DN_IPC"
  prop dfs.datanode.hostname "$H"
  prop dfs.client.use.datanode.hostname true
  prop dfs.datanode.use.datanode.hostname true
  prop dfs.namenode.datanode.registration.ip-hostname-check false
  prop dfs.replication 1
  prop dfs.permissions.enabled false
  prop dfs.webhdfs.enabled true
  prop dfs.namenode.safemode.extension 0
  prop dfs.namenode.safemode.min.datanodes 0
  prop dfs.heartbeat.interval 1
  prop dfs.blocksize 1048576
  prop dfs.namenode.fs-limits.min-block-size 1024
  prop dfs.datanode.du.reserved 0
  prop dfs.namenode.resource.du.reserved 0
  echo '</configuration>'
} > "$CONF/hdfs-site.xml"
cat > "$CONF/log4j.properties" <<'EOF'
log4j.rootLogger=INFO,console
log4j.appender.console=org.apache.log4j.ConsoleAppender
log4j.appender.console.target=System.err
log4j.appender.console.layout=org.apache.log4j.PatternLayout
log4j.appender.console.layout.ConversionPattern=%d{ISO8601} %p %c{2}: %m%n
log4j.logger.org.apache.hadoop.util.NativeCodeLoader=ERROR
EOF

CP=$CONF:$WORK/web:$JARDIR/*
for j in "${JERSEY_JARS[@]}"; do CP=$CP:$JERSEY_DIR/$j; done
JOPTS=(-Xms32m -Xmx512m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.net.preferIPv4Stack=true
  -Dhadoop.log.dir="$LOGS" -Dhadoop.home.dir="$WORK" -Dlog4j.configuration="file:$CONF/log4j.properties"
  "-Drecps.hdfs.dir=$WORK")
# Java 17 runs these paths without --add-opens / --add-exports (measured: format, start, WebHDFS
# and RPC reads, writes, renames). Extra JVM options: RECPS_HDFS_JAVA_OPTS (split on spaces).
# shellcheck disable=SC2206
[ -z "${RECPS_HDFS_JAVA_OPTS:-}" ] || JOPTS+=(${RECPS_HDFS_JAVA_OPTS})

# ---- format, start, wait -------------------------------------------------------------------
T0=$("$PY" -c 'import time; print(time.time())')
timeout 120 "$JAVA" "${JOPTS[@]}" -cp "$CP" org.apache.hadoop.hdfs.server.namenode.NameNode \
    -format -nonInteractive -clusterid recps-test > "$LOGS/format.log" 2>&1 \
  || { tail -n 40 "$LOGS/format.log" >&2; die "namenode -format failed (log: $LOGS/format.log)"; }

started=0
trap 'rc=$?; if [ $rc -ne 0 ] && [ $started = 1 ]; then bash "$HERE/stop_hdfs.sh" "$WORK" >&2 || true; fi' EXIT
# launch NAME CMD...: runs CMD in its own session (setsid: no terminal Ctrl-C / job-control
# signals; stop_hdfs.sh stops it), output in logs/NAME.log, and records its pid in WORK/pids.
# The child writes its own pid before exec, so the pid is right even where setsid has to fork.
SETSID=$(command -v setsid || true)
launch() {
  local name=$1 pid="" i; shift
  started=1
  rm -f "$WORK/$name.pid"
  $SETSID bash -c 'echo $$ > "$0.tmp" && mv "$0.tmp" "$0" && exec "$@"' "$WORK/$name.pid" "$@" \
    > "$LOGS/$name.log" 2>&1 < /dev/null &
  for i in $(seq 100); do [ -s "$WORK/$name.pid" ] && break; sleep 0.1; done
  pid=$(cat "$WORK/$name.pid" 2>/dev/null) || die "$name did not start (log: $LOGS/$name.log)"
  echo "$name $pid" >> "$WORK/pids"
  LAUNCHED=$pid
}
launch namenode "$JAVA" "${JOPTS[@]}" -cp "$CP" org.apache.hadoop.hdfs.server.namenode.NameNode
NN_PID=$LAUNCHED
launch datanode "$JAVA" "${JOPTS[@]}" -cp "$CP" org.apache.hadoop.hdfs.server.datanode.DataNode
DN_PID=$LAUNCHED
if [ -n "${RECPS_HDFS_WATCH_PID:-}" ]; then
  # Stops the cluster when the watched process (the test runner) ends without stopping it;
  # ends by itself once both JVMs are gone.
  launch watchdog bash -c 'while kill -0 "$1" 2>/dev/null; do
      kill -0 "$2" 2>/dev/null || kill -0 "$3" 2>/dev/null || exit 0; sleep 2; done
    exec bash "$4" "$5"' watchdog "$RECPS_HDFS_WATCH_PID" "$NN_PID" "$DN_PID" "$HERE/stop_hdfs.sh" "$WORK"
fi

fail_up() {
  echo "--- $LOGS/namenode.log (tail)" >&2; tail -n 30 "$LOGS/namenode.log" >&2 || true
  echo "--- $LOGS/datanode.log (tail)" >&2; tail -n 30 "$LOGS/datanode.log" >&2 || true
  die "$*"
}
# Ready when the NameNode counts one live DataNode, is out of safe mode and has capacity.
state=""
deadline=$(( $(date +%s) + TIMEOUT ))
while :; do
  kill -0 "$NN_PID" 2>/dev/null || fail_up "the NameNode exited (log: $LOGS/namenode.log)"
  kill -0 "$DN_PID" 2>/dev/null || fail_up "the DataNode exited (log: $LOGS/datanode.log)"
  state=$("$PY" - "$NN_HTTP" <<'EOF' 2>/dev/null || true
import json, sys, urllib.request
base = "http://127.0.0.1:%s/jmx?qry=Hadoop:service=NameNode,name=" % sys.argv[1]
def bean(name):
    with urllib.request.urlopen(base + name, timeout=5) as r:
        return json.load(r)["beans"][0]
fs, info = bean("FSNamesystemState"), bean("NameNodeInfo")
ok = fs["NumLiveDataNodes"] >= 1 and fs["FSState"] == "Operational" and not info["Safemode"] \
    and fs["CapacityRemaining"] > 0
print("ready" if ok else "live=%s state=%s safemode=%r remaining=%s" % (
    fs["NumLiveDataNodes"], fs["FSState"], info["Safemode"], fs["CapacityRemaining"]))
EOF
)
  [ "$state" = ready ] && break
  [ "$(date +%s)" -lt "$deadline" ] || fail_up "not ready after ${TIMEOUT}s (last state: ${state:-no answer on http://$H:$NN_HTTP/jmx})"
  sleep 0.5
done
STARTUP=$("$PY" -c "import time; print(round(time.time() - $T0, 1))")

"$PY" - "$WORK" "$H" "$RPC" "$NN_HTTP" "$NN_PID" "$DN_PID" "$STARTUP" "$JAVA" "$CP" <<'EOF'
import json, os, sys
work, host, rpc, http, nn, dn, startup, java, classpath = sys.argv[1:]
info = {
    "host": host, "rpc_port": int(rpc), "http_port": int(http),
    "url": "hdfs://%s:%s" % (host, rpc), "webhdfs_url": "webhdfs://%s:%s" % (host, http),
    "namenode_pid": int(nn), "datanode_pid": int(dn), "startup_s": float(startup),
    "work_dir": work, "java": java, "hadoop_version": "2.7.3",
    "classpath": classpath,  # the JVMs' (conf first): for Hadoop's own tools, e.g. DFSAdmin
    "logs": {"namenode": work + "/logs/namenode.log", "datanode": work + "/logs/datanode.log",
             "format": work + "/logs/format.log"},
}
with open(work + "/cluster.json.tmp", "w") as f:
    json.dump(info, f, indent=1)
os.replace(work + "/cluster.json.tmp", work + "/cluster.json")
with open(work + "/cluster.env", "w") as f:
    for k in ("host", "rpc_port", "http_port", "url", "webhdfs_url", "namenode_pid", "datanode_pid"):
        f.write("HDFS_%s=%s\n" % (k.upper(), info[k]))
print(json.dumps(info))
EOF
