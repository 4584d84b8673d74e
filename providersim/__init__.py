"""providersim: a simulated cloud provider (GCE-like) served over gRPC.

Capacity reservations on an account (name, flavor, region, total, state) and VM instances on a
flavor, with fault flags: a reservation disappears, its total drops, the API fails at a rate or
stalls. Another program: it imports only the generated provider protocol and its own modules,
never the control plane.
"""
