#!/bin/sh
# As the redis image runs it without a config file: reachable from the other containers (protected mode off; the
# compose network is private).
exec /usr/bin/redis-server "$@" --protected-mode no
