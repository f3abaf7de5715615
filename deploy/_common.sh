# Shared by the deploy scripts: load the settings and check what they need.
set -euo pipefail
HEARTH_ENV="${HEARTH_ENV:-$HOME/.config/hearth/hearth.env}"
if [[ -f "$HEARTH_ENV" ]]; then
    set -a; source "$HEARTH_ENV"; set +a
fi
: "${HEARTH_HEAD_IP:?set HEARTH_HEAD_IP (LAN address of the desktop) in $HEARTH_ENV}"
HEARTH_NODE_IP="${HEARTH_NODE_IP:-$HEARTH_HEAD_IP}"
RAY_GCS_PORT="${RAY_GCS_PORT:-6379}"
RAY_DASHBOARD_PORT="${RAY_DASHBOARD_PORT:-8265}"
RAY_CLIENT_PORT="${RAY_CLIENT_PORT:-10001}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
export RAY_USAGE_STATS_ENABLED=0
RAY="${RAY:-ray}"
HEARTH="${HEARTH:-hearth}"

need_token() {
    if [[ "$RAY_AUTH_MODE" == "token" && -z "${RAY_AUTH_TOKEN:-}" && ! -s "$HOME/.ray/auth_token" ]]; then
        echo "no Ray auth token: copy ~/.ray/auth_token from the desktop (created by desktop-head.sh)" >&2
        exit 1
    fi
}
