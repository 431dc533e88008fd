"""One stop request, however many signals carry it (`stop_signals`).

`timeout` sends SIGTERM to its child and then to the child's process group;
a `//:local_cluster` task killed with its launcher gets SIGTERM once per
launcher thread. Signals within `same_request_secs` of the first are that
first request; a later one is a second signal, which ends the run at once.
Real signals to this process, through the hook's wakeup pipe and watchdog;
the end of the process (`_abort`) is recorded instead.
"""

import os
import signal
import time

import tensorflow as tf

from tf1_safe_train.trainer.run import stop_signals


class StopOnSignalHookTest(tf.test.TestCase):

  def _hook(self, same_request_secs):
    hook = stop_signals.StopOnSignalHook(poll_secs=0.05,
                                         same_request_secs=same_request_secs)
    self.aborts = []
    hook._abort = lambda reason, code: self.aborts.append((reason, code))  # pylint: disable=protected-access
    hook.install()
    self.addCleanup(hook.uninstall)
    return hook

  def _wait(self, predicate):
    deadline = time.monotonic() + 60
    while not predicate() and time.monotonic() < deadline:
      time.sleep(0.01)
    return predicate()

  # Regression test (issue 23, 9): a second SIGTERM of the same request
  # ended the run at once, without its final checkpoint ("second signal").
  def testSignalsWithinTheWindowAreOneRequest(self):
    hook = self._hook(same_request_secs=60.0)
    os.kill(os.getpid(), signal.SIGTERM)
    self.assertTrue(self._wait(lambda: hook.interrupted))
    os.kill(os.getpid(), signal.SIGTERM)  # Handled apart from the first.
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # Several watchdog polls: an abort would be recorded.
    self.assertEqual(self.aborts, [])
    self.assertTrue(hook.interrupted)

  def testASignalAfterTheWindowIsASecondSignal(self):
    hook = self._hook(same_request_secs=0.0)
    os.kill(os.getpid(), signal.SIGTERM)
    self.assertTrue(self._wait(lambda: hook.interrupted))
    os.kill(os.getpid(), signal.SIGTERM)
    self.assertTrue(self._wait(lambda: self.aborts))
    self.assertEqual(self.aborts, [(
        "second signal 15: stopped at once, without the final checkpoint",
        128 + signal.SIGTERM)])

  def testTheWindowIsOneSecond(self):
    self.assertEqual(stop_signals.SAME_REQUEST_SECS, 1.0)

  # Regression test: uninstall waited for the watchdog's select to time out,
  # up to `poll_secs` at the end of every run (1 s by default).
  def testUninstallDoesNotWaitForAPoll(self):
    hook = stop_signals.StopOnSignalHook(poll_secs=120.0)
    hook.install()
    started = time.monotonic()
    hook.uninstall()  # The main thread's: it restores signal handlers.
    # Half the poll: only a woken watchdog lets uninstall return that soon.
    self.assertLess(time.monotonic() - started, 60.0)
    self.assertFalse(hook._thread.is_alive())  # pylint: disable=protected-access


if __name__ == "__main__":
  tf.test.main()
