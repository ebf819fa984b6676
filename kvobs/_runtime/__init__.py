"""Mechanics every layer leans on: bookkeeping an interrupt cannot tear, renewal after fork, engine ids read as
checked ints."""
