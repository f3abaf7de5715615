#!/usr/bin/env bash
# Join the laptop (or any other machine) to the desktop's Ray cluster, with token authentication.
#   deploy/laptop-join.sh             # needs ~/.ray/auth_token copied from the desktop
#   deploy/laptop-join.sh --block     # stay in the foreground (systemd)
source "$(dirname "$0")/_common.sh"
need_token
"$RAY" start --address "$HEARTH_HEAD_IP:$RAY_GCS_PORT" --node-ip-address "$HEARTH_NODE_IP" \
    --resources "{\"${HEARTH_NODE_LABEL:-laptop}\": 1}" --disable-usage-stats "$@"
