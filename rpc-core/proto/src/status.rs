//! Status codes of responses.

/// The status carried by a response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum Status {
    /// The handler returned a value.
    Ok = 0,
    /// No handler is registered for the method id.
    UnknownMethod = 1,
    /// The server could not decode the request.
    BadRequest = 2,
    /// The handler panicked; the server lives on.
    HandlerPanic = 3,
    /// The request or response is above the configured maximum payload.
    PayloadTooLarge = 4,
    /// The call's deadline passed at the server.
    DeadlineExceeded = 5,
    /// The caller cancelled the call.
    Cancelled = 6,
    /// The handler returned an application error.
    Application = 7,
    /// The server failed for a reason of its own (e.g. it could not fetch the request).
    Internal = 8,
    /// The server was serving as many requests of the connection as it allows at once
    /// ([`Session::limit_serving`](crate::Session::limit_serving)): the request was not run.
    Overloaded = 9,
    /// The call's deadline had passed before its handler started: the request was not run.
    Expired = 10,
}

impl Status {
    /// From the wire; unknown codes become [`Status::Internal`].
    pub fn from_u16(v: u16) -> Self {
        match v {
            0 => Status::Ok,
            1 => Status::UnknownMethod,
            2 => Status::BadRequest,
            3 => Status::HandlerPanic,
            4 => Status::PayloadTooLarge,
            5 => Status::DeadlineExceeded,
            6 => Status::Cancelled,
            7 => Status::Application,
            9 => Status::Overloaded,
            10 => Status::Expired,
            _ => Status::Internal,
        }
    }
}
