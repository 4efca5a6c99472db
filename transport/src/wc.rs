//! Work completion status and opcode, mirroring `ibv_wc_status` and `ibv_wc_opcode`.

use std::fmt;

/// The status of a work completion; the values and names are those of `enum ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum WcStatus {
    /// IBV_WC_SUCCESS
    Success = 0,
    /// IBV_WC_LOC_LEN_ERR: a receive buffer too small, or a local length violation.
    LocLenErr = 1,
    /// IBV_WC_LOC_QP_OP_ERR
    LocQpOpErr = 2,
    /// IBV_WC_LOC_EEC_OP_ERR
    LocEecOpErr = 3,
    /// IBV_WC_LOC_PROT_ERR: a local buffer not registered in this QP's protection domain.
    LocProtErr = 4,
    /// IBV_WC_WR_FLUSH_ERR: flushed because the QP is in the error state.
    WrFlushErr = 5,
    /// IBV_WC_MW_BIND_ERR
    MwBindErr = 6,
    /// IBV_WC_BAD_RESP_ERR
    BadRespErr = 7,
    /// IBV_WC_LOC_ACCESS_ERR
    LocAccessErr = 8,
    /// IBV_WC_REM_INV_REQ_ERR: the responder found the request invalid (e.g. too long, misaligned atomic).
    RemInvReqErr = 9,
    /// IBV_WC_REM_ACCESS_ERR: wrong rkey, out of bounds or missing access flag at the target.
    RemAccessErr = 10,
    /// IBV_WC_REM_OP_ERR
    RemOpErr = 11,
    /// IBV_WC_RETRY_EXC_ERR: the peer stopped answering (dead process, cut link).
    RetryExcErr = 12,
    /// IBV_WC_RNR_RETRY_EXC_ERR: the receiver had no receive posted, after every retry.
    RnrRetryExcErr = 13,
    /// IBV_WC_LOC_RDD_VIOL_ERR
    LocRddViolErr = 14,
    /// IBV_WC_REM_INV_RD_REQ_ERR
    RemInvRdReqErr = 15,
    /// IBV_WC_REM_ABORT_ERR
    RemAbortErr = 16,
    /// IBV_WC_INV_EECN_ERR
    InvEecnErr = 17,
    /// IBV_WC_INV_EEC_STATE_ERR
    InvEecStateErr = 18,
    /// IBV_WC_FATAL_ERR
    FatalErr = 19,
    /// IBV_WC_RESP_TIMEOUT_ERR
    RespTimeoutErr = 20,
    /// IBV_WC_GENERAL_ERR
    GeneralErr = 21,
}

impl WcStatus {
    /// Maps a raw `ibv_wc_status` value; unknown values become [`WcStatus::GeneralErr`].
    pub fn from_raw(v: u32) -> Self {
        use WcStatus::*;
        const ALL: [WcStatus; 22] = [
            Success,
            LocLenErr,
            LocQpOpErr,
            LocEecOpErr,
            LocProtErr,
            WrFlushErr,
            MwBindErr,
            BadRespErr,
            LocAccessErr,
            RemInvReqErr,
            RemAccessErr,
            RemOpErr,
            RetryExcErr,
            RnrRetryExcErr,
            LocRddViolErr,
            RemInvRdReqErr,
            RemAbortErr,
            InvEecnErr,
            InvEecStateErr,
            FatalErr,
            RespTimeoutErr,
            GeneralErr,
        ];
        ALL.get(v as usize).copied().unwrap_or(GeneralErr)
    }

    /// True for [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }

    /// The name `ibv_wc_status_str` gives, so logs read the same on every provider.
    pub fn as_str(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "success",
            LocLenErr => "local length error",
            LocQpOpErr => "local QP operation error",
            LocEecOpErr => "local EE context operation error",
            LocProtErr => "local protection error",
            WrFlushErr => "Work Request Flushed Error",
            MwBindErr => "memory management operation error",
            BadRespErr => "bad response error",
            LocAccessErr => "local access error",
            RemInvReqErr => "remote invalid request error",
            RemAccessErr => "remote access error",
            RemOpErr => "remote operation error",
            RetryExcErr => "transport retry counter exceeded",
            RnrRetryExcErr => "RNR retry counter exceeded",
            LocRddViolErr => "local RDD violation error",
            RemInvRdReqErr => "remote invalid RD request",
            RemAbortErr => "aborted error",
            InvEecnErr => "invalid EE context number",
            InvEecStateErr => "invalid EE context state",
            FatalErr => "fatal error",
            RespTimeoutErr => "response timeout error",
            GeneralErr => "general error",
        }
    }

    /// A hint for the operator, where the status has a usual cause.
    ///
    /// ```
    /// use rdma_rpc_transport::WcStatus;
    /// // Flushed: the request never ran, because the QP had failed or closed before it.
    /// assert!(WcStatus::WrFlushErr.hint().is_some_and(|h| h.contains("not carried out")));
    /// assert_eq!(WcStatus::Success.hint(), None);
    /// ```
    pub fn hint(self) -> Option<&'static str> {
        match self {
            WcStatus::RetryExcErr => {
                Some("the peer stopped answering: process dead, link down, or on RoCE a lossy fabric (check PFC/ECN)")
            }
            _ => self.hint_on("verbs"),
        }
    }

    /// As [`WcStatus::hint`], worded for `provider` (`tcp`, `shm`, `verbs`): the software
    /// providers have no fabric to tune, so a peer that stopped answering there is a process
    /// or a connection that went away.
    ///
    /// ```
    /// use rdma_rpc_transport::WcStatus;
    /// assert!(WcStatus::RetryExcErr.hint_on("tcp").is_some_and(|h| !h.contains("PFC")));
    /// assert!(WcStatus::RetryExcErr.hint_on("verbs").is_some_and(|h| h.contains("PFC")));
    /// ```
    pub fn hint_on(self, provider: &str) -> Option<&'static str> {
        match self {
            WcStatus::RetryExcErr if provider == "tcp" => Some(
                "the peer stopped answering: its process died or stopped, its host went away, or the TCP connection broke",
            ),
            WcStatus::RetryExcErr if provider.starts_with("shm") => {
                Some("the peer stopped answering: its process died or stopped")
            }
            WcStatus::RetryExcErr => {
                Some("the peer stopped answering: process dead, link down, or on RoCE a lossy fabric (check PFC/ECN)")
            }
            WcStatus::RnrRetryExcErr => {
                Some("the receiver had no receive posted: post receives before the peer sends (credits)")
            }
            WcStatus::RemAccessErr => Some("check rkey, address range and the region's REMOTE_* access flags"),
            WcStatus::WrFlushErr => Some(
                "the QP is in the error state, so this request was not carried out: the connection was closed, \
                 its peer's process ended, the link dropped, or an earlier request on the QP failed",
            ),
            _ => None,
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a completion completed; mirrors `enum ibv_wc_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// IBV_WC_SEND (also for SEND_WITH_IMM)
    Send,
    /// IBV_WC_RDMA_WRITE (also for RDMA_WRITE_WITH_IMM at the initiator)
    RdmaWrite,
    /// IBV_WC_RDMA_READ
    RdmaRead,
    /// IBV_WC_COMP_SWAP
    CompSwap,
    /// IBV_WC_FETCH_ADD
    FetchAdd,
    /// IBV_WC_RECV
    Recv,
    /// IBV_WC_RECV_RDMA_WITH_IMM: an RDMA Write with immediate consumed this receive.
    RecvRdmaWithImm,
}
