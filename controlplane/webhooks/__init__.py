"""Webhooks: signed HTTP delivery of a tenant's events.

- `manage`: create, get, list, delete and the deliveries listing (membership and IAM first).
- `delivery`: the worker that claims due deliveries, POSTs them and records the outcome.
- `signing`: the body, the Standard Webhooks headers and signature, and the whsec_ secrets.
- `sender`: one HTTP POST on the event loop under a total deadline, with fixed error texts.
- `targets`: a URL's host resolved and judged: public addresses only, unless allowlisted.

Deliveries are fanned out by a trigger in the event's own transaction (migration 0005).
"""
