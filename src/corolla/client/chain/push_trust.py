"""PushTrust: which servers of a chain may push steps to which (client/chain/chain.py).

Every reply names the inputs its step ran (wire/digest.py). A server that replied to a pushed copy of a
step unlike the client's own got a forged push: the span stream skips that reply and waits for the one
to its own copy, or, when the forged copy left the server unable to take the client's (it kept another
path of a token tree), the server refuses the client's copy (ForgedPush). The first hop of a step to meet
a forgery blames its previous server: the client never again names that server as the one that may push
to it (`push_from`), so the receiver refuses its pushes, in this session and in a replacement session.
Later hops of the same step only got the forgery passed on by an honest server, and blame no one.

A server that refused the client's copy because of a forged push is not at fault: it is replaced by a new
session (on itself, if routing picks it) without a ban, once per chain; a server that claims this again
is banned as any failed server is (a lying server could claim it every step). Nothing is reported to the
swarm: a forged reply could also be the receiving server's own lie about what it ran.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class PushTrust:
    def __init__(self) -> None:
        self._forged: set[tuple[str, str]] = set()  # (pushing peer, receiving peer)
        self._excused: set[str] = set()  # servers replaced without a ban after a forged push

    def allows(self, pusher: str, receiver: str) -> bool:
        return (pusher, receiver) not in self._forged

    def distrust(self, pusher: str | None, receiver: str) -> None:
        """`pusher` pushed `receiver` other inputs than this client sent it under a step's id."""
        if pusher is None or (pusher, receiver) in self._forged:
            return
        self._forged.add((pusher, receiver))
        short = (pusher[-6:], receiver[-6:])
        logger.warning(
            "Server ...%s pushed inputs unlike this client's to ...%s: it may no longer push there", *short
        )

    def met(self, seen: bool, here: bool, pusher: str | None, receiver: str) -> bool:
        """Whether a step met a forged push so far (`seen` at earlier hops, `here` at `receiver`): the first
        hop to meet one blames its pusher (later hops only got the forgery passed on by honest servers)."""
        if here and not seen:
            self.distrust(pusher, receiver)
        return seen or here

    def excuse(self, receiver: str) -> bool:
        """Whether `receiver`, which a forged push made refuse a step, is replaced without a ban."""
        if receiver in self._excused:
            return False
        self._excused.add(receiver)
        return True
