"""Test-session set-up shared by every test module."""
import signal

# A shell that starts a job in the background (`pytest ... &`, some CI runners) starts it with
# SIGINT ignored, and an ignored signal stays ignored across exec: the Ctrl-C tests' child
# processes would then never see a KeyboardInterrupt.  Give them Python's usual handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
