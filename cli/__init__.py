"""The command line: the top layer, beside `flows/`; it runs flows and prints what a user needs."""
