"""The steps of a run, in order, each journalled before it changes anything."""
