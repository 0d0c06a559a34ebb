"""What comes next, with no network: sampling, grammars, text, the chooser, drafts and their verification.

The client's decode loop (client/generation/loop.py), the API and the CLI use these; nothing here talks to a
server.
"""
