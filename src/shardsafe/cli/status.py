"""The exit status of every ``shardsafe`` command, defined once: 0 all is well, 1 a checkpoint (or an
import's source) is corrupt, incomplete or missing, or a target is refused; 2 a usage error."""

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2
