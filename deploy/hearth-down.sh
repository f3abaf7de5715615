#!/usr/bin/env bash
# Remove the deployment (the Ray nodes keep running; stop them with `ray stop` on each machine).
source "$(dirname "$0")/_common.sh"
need_token
exec "$HEARTH" down --address "$HEARTH_HEAD_IP:$RAY_GCS_PORT" "$@"
