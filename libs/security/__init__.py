"""Teams on NATS (docs/security.md): who may connect, what each team may reach, and TLS.

- ``teams``: the teams file (names, public nkeys, limits, revocations) and the credential
  files that ``strait teams add`` writes;
- ``server_config``: the nats-server configuration those imply (the fleet's account, one
  account per team, the exports and imports between them, TLS);
- ``tls``: a development certificate authority for ``strait up --secure``.

Nothing here runs in a request's path: the CLI writes files, nats-server enforces them, and
the router reads the teams file for limits and revocations.
"""
