//! Stopping a run cleanly: the first SIGINT (Ctrl-C) or SIGTERM asks the
//! run to finish the step it is in, save a checkpoint and exit; a second
//! one ends the process at once.
//!
//! [`install`] sets the handlers (the `weft` binary calls it; a program
//! embedding the trainer may instead call [`request`] from its own
//! handling). After every step the training loop asks for the request of
//! any rank, so that every rank stops after the same step and saves its
//! part of the same checkpoint; a [`Supervisor`](crate::Supervisor)
//! forwards the request to its job instead of restarting it.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Asks the runs of this process to stop after their current step (what
/// the first signal does).
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Whether a stop has been asked for in this process.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}

const MESSAGE: &[u8] =
    b"\nweft: stopping after this step and saving a checkpoint (signal again to stop at once)\n";

extern "C" fn on_signal(signal: libc::c_int) {
    if REQUESTED.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe; the second signal ends the
        // process at once, as the user asked.
        unsafe { libc::_exit(128 + signal) };
    }
    // SAFETY: write(2) is async-signal-safe; the buffer is a static.
    unsafe {
        libc::write(2, MESSAGE.as_ptr().cast(), MESSAGE.len());
    }
}

/// Installs the SIGINT and SIGTERM handlers: the first signal calls
/// [`request`] (and says so on stderr), the second ends the process with
/// status 128 + the signal.
///
/// # Errors
/// The OS error if a handler cannot be installed.
pub fn install() -> std::io::Result<()> {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a handler of the signature
        // sa_handler expects, an empty mask and SA_RESTART; the handler
        // only touches an atomic and async-signal-safe calls.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
