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
#
# KAFKA_SECURE=1 (at the first start of a STATE_DIR) adds two secured listeners for testing
# clients against a production-like cluster; needs the openssl CLI:
#   SASL_SSL  SASL PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512 over TLS; one user, "panagg", whose
#             password (random, made here) is in STATE_DIR/secrets/password
#   SSL       TLS with a client certificate required (mutual TLS)
# A throwaway CA made here signs the server certificate (SAN IP:127.0.0.1 only) and a client
# certificate: STATE_DIR/tls/{ca.pem, client.pem, client.key}; STATE_DIR/tls/other-ca.pem is an
# unrelated CA (for testing a wrong trust store). Start prints "sasl_ssl=127.0.0.1:PORT" and
# "ssl=127.0.0.1:PORT" before the bootstrap line. Test material only: never reuse these keys.
#
# KAFKA_PROPERTIES (at every start): extra server.properties lines, e.g.
# "log.retention.check.interval.ms=5000" for a test of retention (tests/chaos/harness.py).
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

# a throwaway CA, a server certificate for 127.0.0.1, a client certificate, a SASL password
make_secrets() {
  command -v openssl >/dev/null || die "openssl not found; KAFKA_SECURE=1 needs it (Debian package openssl)"
  local tls="$state/tls" sec="$state/secrets"
  [ -f "$tls/.complete" ] && return
  mkdir -p "$tls" "$sec"
  chmod 700 "$sec"
  (
    set -e
    cd "$tls"
    q() { "$@" >/dev/null 2>&1; }
    q openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=panagg test CA" \
        -keyout ca.key -out ca.pem
    q openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=unrelated test CA" \
        -keyout other-ca.key -out other-ca.pem
    q openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout server.key -out server.csr
    printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > server.ext
    q openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
        -extfile server.ext -out server.pem
    q openssl req -newkey rsa:2048 -nodes -subj "/CN=panagg-client" -keyout client.key -out client.csr
    printf 'extendedKeyUsage=clientAuth\n' > client.ext
    q openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
        -extfile client.ext -out client.pem
    openssl rand -hex 16 > store.password
    q openssl pkcs12 -export -in server.pem -inkey server.key -certfile ca.pem -name server \
        -passout "file:store.password" -out server.p12
    rm -f ./*.csr ./*.ext ./*.srl
  ) || die "making the test CA and certificates with openssl failed"
  [ -f "$sec/password" ] || openssl rand -hex 16 > "$sec/password"
  chmod 600 "$sec/password" "$tls/ca.key" "$tls/other-ca.key" "$tls/server.key" "$tls/client.key"
  touch "$tls/.complete"
}

running() { [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null; }

start() {
  fetch
  if running; then
    if [ -f "$state/sport" ]; then
      echo "sasl_ssl=127.0.0.1:$(cat "$state/sport")"; echo "ssl=127.0.0.1:$(cat "$state/mport")"
    fi
    echo "bootstrap=127.0.0.1:$(cat "$state/port")"; return
  fi
  mkdir -p "$state/data" "$state/logs"
  local port cport cp
  local secure=${KAFKA_SECURE:-0} sport="" mport=""
  [ -f "$state/sport" ] && secure=1  # a secured state dir stays secured
  if [ -f "$state/port" ] && [ -f "$state/cport" ]; then
    # the same ports as the last start of this state dir: running clients reconnect to them
    port=$(cat "$state/port"); cport=$(cat "$state/cport")
    port_free "$port" || die "port $port of $state (its previous start) is taken; stop what holds it, or use another STATE_DIR"
    port_free "$cport" || die "controller port $cport of $state is taken; stop what holds it, or use another STATE_DIR"
    if [ "$secure" = 1 ] && [ -f "$state/sport" ]; then
      sport=$(cat "$state/sport"); mport=$(cat "$state/mport")
      port_free "$sport" || die "SASL_SSL port $sport of $state is taken; stop what holds it, or use another STATE_DIR"
      port_free "$mport" || die "SSL port $mport of $state is taken; stop what holds it, or use another STATE_DIR"
    fi
  else
    port=$(free_port); cport=$(free_port)
    while [ "$cport" = "$port" ]; do cport=$(free_port); done
  fi
  if [ "$secure" = 1 ] && [ -z "$sport" ]; then
    sport=$(free_port); mport=$(free_port)
    while [ "$sport" = "$port" ] || [ "$sport" = "$cport" ]; do sport=$(free_port); done
    while [ "$mport" = "$port" ] || [ "$mport" = "$cport" ] || [ "$mport" = "$sport" ]; do mport=$(free_port); done
  fi
  local listeners="PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport"
  local advertised="PLAINTEXT://127.0.0.1:$port"
  local protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
  if [ "$secure" = 1 ]; then
    make_secrets
    listeners="$listeners,SASL_SSL://127.0.0.1:$sport,SSL://127.0.0.1:$mport"
    advertised="$advertised,SASL_SSL://127.0.0.1:$sport,SSL://127.0.0.1:$mport"
    protocols="$protocols,SASL_SSL:SASL_SSL,SSL:SSL"
  fi
  cat > "$state/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=$listeners
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=$protocols
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
  if [ -n "${KAFKA_PROPERTIES:-}" ]; then printf '%s\n' "$KAFKA_PROPERTIES" >> "$state/server.properties"; fi
  if [ "$secure" = 1 ]; then
    local pw store; pw=$(cat "$state/secrets/password"); store=$(cat "$state/tls/store.password")
    cat >> "$state/server.properties" <<PROPS
ssl.keystore.type=PKCS12
ssl.keystore.location=$state/tls/server.p12
ssl.keystore.password=$store
ssl.key.password=$store
ssl.truststore.type=PEM
ssl.truststore.location=$state/tls/ca.pem
listener.name.ssl.ssl.client.auth=required
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="panagg" password="$pw" user_panagg="$pw";
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
PROPS
    chmod 600 "$state/server.properties"
  fi
  cp="$libs/*"
  local jopts=(-Xms256m -Xmx1g -Dlog4j.configuration="file:$here/log4j.properties"
               -Dkafka.logs.dir="$state/logs")
  if [ ! -f "$state/data/meta.properties" ]; then
    local uuid
    uuid=$(java -cp "$cp" "${jopts[@]}" kafka.tools.StorageTool random-uuid)
    local scram=()
    if [ "$secure" = 1 ]; then  # SCRAM credentials live in the KRaft metadata from the start
      local pw; pw=$(cat "$state/secrets/password")
      scram=(--add-scram "SCRAM-SHA-256=[name=panagg,password=$pw]"
             --add-scram "SCRAM-SHA-512=[name=panagg,password=$pw]")
    fi
    java -cp "$cp" "${jopts[@]}" kafka.tools.StorageTool format -t "$uuid" \
         -c "$state/server.properties" "${scram[@]}" >"$state/logs/format.log" 2>&1 \
      || die "formatting KRaft storage failed; see $state/logs/format.log"
  fi
  echo "$port" > "$state/port"
  echo "$cport" > "$state/cport"
  if [ "$secure" = 1 ]; then echo "$sport" > "$state/sport"; echo "$mport" > "$state/mport"; fi
  # a restart's log starts empty: the readiness check below must not find the last run's line
  if [ -f "$state/logs/server.log" ]; then mv -f "$state/logs/server.log" "$state/logs/server.log.prev"; fi
  nohup java -cp "$cp" "${jopts[@]}" kafka.Kafka "$state/server.properties" \
      >"$state/logs/stdout.log" 2>&1 &
  echo $! > "$state/pid"
  for _ in $(seq 1 120); do
    if ! running; then die "broker exited during start-up; see $state/logs/server.log"; fi
    if grep -q "Kafka Server started" "$state/logs/server.log" 2>/dev/null; then
      if [ "$secure" = 1 ]; then echo "sasl_ssl=127.0.0.1:$sport"; echo "ssl=127.0.0.1:$mport"; fi
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
