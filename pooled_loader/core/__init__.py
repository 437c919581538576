"""The shared vocabulary of every layer: errors, policy constants, safe file opening, the
nested-tree walker, state checks, seeds, ranks, the Stateful protocol test and an image folder's
listing.

Imports nothing of pooled_loader outside core/."""
