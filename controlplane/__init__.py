"""Better Compute control plane: admits and places GPU reservations in PostgreSQL."""
