#!/bin/sh
# On first start: initdb $PGDATA as the postgres user with $POSTGRES_USER / $POSTGRES_PASSWORD
# (SCRAM, from any address) and create $POSTGRES_DB; then run the server in the foreground
# as PID 1, listening on every interface of the container.
set -eu
bin=/usr/lib/postgresql/15/bin
user=${POSTGRES_USER:-postgres}
as_pg() { setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"; }
mkdir -p /var/run/postgresql  # the socket directory (a tmpfs on a booted Debian)
chown postgres:postgres /var/run/postgresql
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    mkdir -p "$PGDATA"
    chown postgres:postgres "$PGDATA"
    chmod 700 "$PGDATA"
    pwfile=$(mktemp)
    printf '%s\n' "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}" > "$pwfile"
    chown postgres "$pwfile"
    as_pg "$bin/initdb" -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth=scram-sha-256 \
        -E UTF8 --locale=C.UTF-8 --no-instructions >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    db=${POSTGRES_DB:-$user}
    if [ "$db" != postgres ]; then
        echo "CREATE DATABASE \"$db\"" | as_pg "$bin/postgres" --single -D "$PGDATA" template1 >/dev/null
    fi
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups -- \
    "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' -c max_connections=200
