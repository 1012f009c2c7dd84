# Sourced by scripts/compose-up and scripts/compose-down: which engine runs the deploy, and the
# compose command that drives it. Not a command of its own.
#
# Engine (LANES_ENGINE=docker|podman chooses; otherwise found):
#   docker  a Docker engine answers `docker info` (and `docker` is not podman's docker shim):
#           `docker compose` (v2), else `docker-compose`, on docker-compose.yml as it is
#           (a docker-compose.override.yml next to it applies, as compose always does);
#   podman  podman is installed: its Docker-compatible socket (scripts/podman-service, in
#           LANES_PODMAN_DIR) driven by `docker-compose` (or `docker compose`), with the local
#           images of scripts/build-local-images named by docker-compose.local.yml.
# Passwords and other variables: the environment, then LANES_ENV_FILE (default ./.env).

cd "$(dirname "$0")/.."
ENV_FILE=${LANES_ENV_FILE:-.env}
case "$ENV_FILE" in /*) ;; *) ENV_FILE="$PWD/$ENV_FILE" ;; esac
PODMAN_DIR=${LANES_PODMAN_DIR:-${XDG_RUNTIME_DIR:-/tmp}/lanes-podman}
STARTED_MARK="$PODMAN_DIR/started-by-compose-up"  # compose-down stops only a service compose-up started

say() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; }
die() { say "$*"; exit 1; }

# The password variables docker-compose.yml requires (`${NATS_..._PASSWORD:?...}`): a host added
# to the file (docs/deploy.md section 5) needs no change here.
password_variables() {
  grep -oE '\$\{NATS_[A-Z0-9_]+_PASSWORD:\?' docker-compose.yml | sed -e 's/^\${//' -e 's/:?$//' | sort -u
}

# The secrets compose-up generates when missing: the NATS passwords, then the gateway's API key.
secret_variables() {
  password_variables
  echo LANES_GATEWAY_API_KEYS
}

# Whether VAR has a value in the environment or in the env file (compose reads both, the
# environment first).
has_value() {
  local var=$1
  [ -n "${!var:-}" ] && return 0
  [ -f "$ENV_FILE" ] && grep -qE "^[[:space:]]*${var}=.+" "$ENV_FILE"
}

docker_engine() {
  command -v docker >/dev/null || return 1
  docker --version 2>/dev/null | grep -qi podman && return 1  # podman-docker's shim: use podman itself
  docker info >/dev/null 2>&1
}

find_engine() {
  case "${LANES_ENGINE:-}" in
    docker | podman) ENGINE=$LANES_ENGINE ;;
    "")
      if docker_engine; then ENGINE=docker
      elif command -v podman >/dev/null; then ENGINE=podman
      else die "no container engine: install Docker (with its compose plugin) or podman (Debian: apt-get install -y podman catatonit debootstrap docker-compose)"
      fi ;;
    *) die "LANES_ENGINE is '$LANES_ENGINE'; it may be docker or podman" ;;
  esac
}

# COMPOSE: the compose command as an array, for the engine found.
compose_command() {
  local tool=()
  if [ "$ENGINE" = docker ]; then
    if docker compose version >/dev/null 2>&1; then tool=(docker compose)
    elif command -v docker-compose >/dev/null; then tool=(docker-compose)
    else die "the Docker engine answers but there is no compose: install the compose plugin (docker compose) or docker-compose"
    fi
  else
    if command -v docker-compose >/dev/null; then tool=(docker-compose)
    elif command -v docker >/dev/null && docker compose version >/dev/null 2>&1; then tool=(docker compose)
    else die "podman needs docker-compose to drive it (Debian: apt-get install -y docker-compose)"
    fi
  fi
  COMPOSE=("${tool[@]}")
  [ -f "$ENV_FILE" ] && COMPOSE+=(--env-file "$ENV_FILE")
  if [ "$ENGINE" = podman ]; then
    COMPOSE+=(-f docker-compose.yml -f docker-compose.local.yml)
    [ -f docker-compose.override.yml ] && COMPOSE+=(-f docker-compose.override.yml)
  fi
  return 0
}

podman_socket_up() {  # sets DOCKER_HOST; notes when it was this script that started the service
  if bash scripts/podman-service status "$PODMAN_DIR"; then
    export DOCKER_HOST="unix://$PODMAN_DIR/podman.sock"
    return 0
  fi
  eval "$(bash scripts/podman-service start "$PODMAN_DIR")"
  touch "$STARTED_MARK"
}

podman_socket_down() {  # stops the service only when compose-up (or compose-down) started it
  if [ -f "$STARTED_MARK" ]; then
    bash scripts/podman-service stop "$PODMAN_DIR"
    rm -f "$STARTED_MARK"
  fi
}
