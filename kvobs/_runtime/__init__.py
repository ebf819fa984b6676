"""Process mechanics every layer leans on: bookkeeping an interrupt cannot tear, renewal after fork."""
