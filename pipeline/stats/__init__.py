"""Statistics: paired differences, clusters, intervals, bootstrap, Tango's bound, scoring rules."""
