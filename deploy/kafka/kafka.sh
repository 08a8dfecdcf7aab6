#!/usr/bin/env bash
# A real single-node Apache Kafka broker (KRaft mode) on 127.0.0.1, from Maven Central jars.
#
#   deploy/kafka/kafka.sh fetch                 resolve the pinned broker jars (cached in ~/.m2)
#   deploy/kafka/kafka.sh start [STATE_DIR]     format KRaft storage, start on a free port
#                                               (a restart of the same STATE_DIR reuses it),
#                                               wait until it accepts connections, print
#                                               "bootstrap=127.0.0.1:PORT"
#   deploy/kafka/kafka.sh stop  [STATE_DIR]     stop it cleanly (SIGTERM, then wait)
#   deploy/kafka/kafka.sh status [STATE_DIR]
#
# STATE_DIR defaults to ./var/kafka; it holds the config, data, logs, pid and port.
# Needs java (17+) and mvn on PATH. No Docker, nothing outside loopback.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:-}
state=$(realpath -m "${2:-var/kafka}")
libs="$here/libs"

die() { echo "kafka.sh: $*" >&2; exit 2; }

fetch() {
  command -v mvn >/dev/null || die "mvn not found; install Maven (Debian package maven)"
  command -v java >/dev/null || die "java not found; install a JDK 17+ (Debian package openjdk-17-jre-headless)"
  if [ -f "$libs/.complete" ] && [ "$libs/.complete" -nt "$here/pom.xml" ]; then return; fi
  rm -rf "$libs"
  mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies \
      -DoutputDirectory="$libs" -DincludeScope=runtime >&2 \
    || die "could not fetch the Kafka jars from Maven Central (see the mvn output above)"
  touch "$libs/.complete"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

port_free() {
  python3 -c 'import socket, sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", int(sys.argv[1]))); s.close()' "$1" 2>/dev/null
}

running() { [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null; }

start() {
  fetch
  if running; then echo "bootstrap=127.0.0.1:$(cat "$state/port")"; return; fi
  mkdir -p "$state/data" "$state/logs"
  local port cport cp
  if [ -f "$state/port" ] && [ -f "$state/cport" ]; then
    # the same ports as the last start of this state dir: running clients reconnect to them
    port=$(cat "$state/port"); cport=$(cat "$state/cport")
    port_free "$port" || die "port $port of $state (its previous start) is taken; stop what holds it, or use another STATE_DIR"
    port_free "$cport" || die "controller port $cport of $state is taken; stop what holds it, or use another STATE_DIR"
  else
    port=$(free_port); cport=$(free_port)
    while [ "$cport" = "$port" ]; do cport=$(free_port); done
  fi
  cat > "$state/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$state/data
num.partitions=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
log.retention.hours=24
PROPS
  cp="$libs/*"
  local jopts=(-Xms256m -Xmx1g -Dlog4j.configuration="file:$here/log4j.properties"
               -Dkafka.logs.dir="$state/logs")
  if [ ! -f "$state/data/meta.properties" ]; then
    local uuid
    uuid=$(java -cp "$cp" "${jopts[@]}" kafka.tools.StorageTool random-uuid)
    java -cp "$cp" "${jopts[@]}" kafka.tools.StorageTool format -t "$uuid" \
         -c "$state/server.properties" >"$state/logs/format.log" 2>&1 \
      || die "formatting KRaft storage failed; see $state/logs/format.log"
  fi
  echo "$port" > "$state/port"
  echo "$cport" > "$state/cport"
  nohup java -cp "$cp" "${jopts[@]}" kafka.Kafka "$state/server.properties" \
      >"$state/logs/stdout.log" 2>&1 &
  echo $! > "$state/pid"
  for _ in $(seq 1 120); do
    if ! running; then die "broker exited during start-up; see $state/logs/server.log"; fi
    if grep -q "Kafka Server started" "$state/logs/server.log" 2>/dev/null; then
      echo "bootstrap=127.0.0.1:$port"; return
    fi
    sleep 0.5
  done
  die "broker did not start within 60 s; see $state/logs/server.log"
}

stop() {
  if ! running; then rm -f "$state/pid"; return; fi
  local pid; pid=$(cat "$state/pid")
  kill -TERM "$pid"
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || { rm -f "$state/pid"; return; }; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$state/pid"
}

case "$cmd" in
  fetch) fetch ;;
  start) start ;;
  stop) stop ;;
  status) if running; then echo "running bootstrap=127.0.0.1:$(cat "$state/port")"; else echo "stopped"; exit 1; fi ;;
  *) die "usage: kafka.sh fetch|start|stop|status [STATE_DIR]" ;;
esac
