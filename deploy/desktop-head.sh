#!/usr/bin/env bash
# Start the Ray head node on the desktop (the machine with the GPU), with token authentication.
#   deploy/desktop-head.sh            # then: deploy/hearth-up.sh
#   deploy/desktop-head.sh --block    # stay in the foreground (systemd)
source "$(dirname "$0")/_common.sh"
if [[ "$RAY_AUTH_MODE" == "token" && -z "${RAY_AUTH_TOKEN:-}" ]]; then
    "$RAY" get-auth-token --generate >/dev/null   # creates ~/.ray/auth_token once
fi
"$RAY" start --head --node-ip-address "$HEARTH_NODE_IP" --port "$RAY_GCS_PORT" \
    --dashboard-host "$HEARTH_NODE_IP" --dashboard-port "$RAY_DASHBOARD_PORT" \
    --ray-client-server-port "$RAY_CLIENT_PORT" \
    --resources '{"desktop": 1}' --disable-usage-stats "$@"
echo "Ray head on $HEARTH_NODE_IP:$RAY_GCS_PORT. On the laptop: copy ~/.ray/auth_token, then run deploy/laptop-join.sh"
