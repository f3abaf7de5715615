#!/usr/bin/env bash
# Deploy the model onto the running cluster (run on the desktop after desktop-head.sh, and after the
# laptop joined). The router listens on $HEARTH_HOST:$HEARTH_PORT; on the LAN it requires the key.
source "$(dirname "$0")/_common.sh"
need_token
: "${HEARTH_MODEL:?set HEARTH_MODEL (the checkpoint directory, same path on every machine)}"
HEARTH_HOST="${HEARTH_HOST:-127.0.0.1}"
if [[ "$HEARTH_HOST" != "127.0.0.1" && ( -z "${HEARTH_API_KEY:-}" || "${HEARTH_API_KEY}" == "change-me" ) ]]; then
    echo "refusing to open the API to the LAN without HEARTH_API_KEY (see hearth.env.example)" >&2
    exit 1
fi
exec "$HEARTH" up --address "$HEARTH_HEAD_IP:$RAY_GCS_PORT" --model "$HEARTH_MODEL" \
    --host "$HEARTH_HOST" --port "${HEARTH_PORT:-8000}" ${HEARTH_API_KEY:+--api-key "$HEARTH_API_KEY"} "$@"
