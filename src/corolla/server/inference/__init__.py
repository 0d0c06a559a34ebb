"""An inference session as the server runs it: steps taken, checked and ledgered, pushed on; cache-free
passes."""
