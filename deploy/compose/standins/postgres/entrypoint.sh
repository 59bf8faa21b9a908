#!/bin/sh
# First start: initdb into $PGDATA with $POSTGRES_USER (password $POSTGRES_PASSWORD, scram over
# TCP, trust on the local socket) and create $POSTGRES_DB; every start: run the server as user
# postgres, listening on every address, as PID 1.
set -eu
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    chown postgres:postgres "$PGDATA" && chmod 700 "$PGDATA"
    pwfile=$(mktemp) && printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile" && chown postgres "$pwfile"
    as_postgres initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
        as_postgres pg_ctl -D "$PGDATA" -w -o "-c listen_addresses=''" start >/dev/null
        as_postgres createdb -U "$POSTGRES_USER" "$POSTGRES_DB"
        as_postgres pg_ctl -D "$PGDATA" -w stop >/dev/null
    fi
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups \
    postgres -D "$PGDATA" -c listen_addresses='*' "$@"
