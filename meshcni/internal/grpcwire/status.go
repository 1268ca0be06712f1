package grpcwire

import (
	"errors"
	"strconv"
)

// Code is a gRPC status code (the values of google.golang.org/grpc/codes).
type Code uint32

// The codes this client produces or its callers branch on.
const (
	OK                Code = 0
	Canceled          Code = 1
	Unknown           Code = 2
	InvalidArgument   Code = 3
	DeadlineExceeded  Code = 4
	NotFound          Code = 5
	PermissionDenied  Code = 7
	ResourceExhausted Code = 8
	Unimplemented     Code = 12
	Internal          Code = 13
	Unavailable       Code = 14
	Unauthenticated   Code = 16
)

var codeNames = map[Code]string{
	OK: "OK", Canceled: "Canceled", Unknown: "Unknown", InvalidArgument: "InvalidArgument",
	DeadlineExceeded: "DeadlineExceeded", NotFound: "NotFound", 6: "AlreadyExists",
	PermissionDenied: "PermissionDenied", ResourceExhausted: "ResourceExhausted",
	9: "FailedPrecondition", 10: "Aborted", 11: "OutOfRange", Unimplemented: "Unimplemented",
	Internal: "Internal", Unavailable: "Unavailable", 15: "DataLoss", Unauthenticated: "Unauthenticated",
}

// String is the code's name as grpc-go spells it.
func (c Code) String() string {
	if n, ok := codeNames[c]; ok {
		return n
	}
	return "Code(" + strconv.FormatUint(uint64(c), 10) + ")"
}

// Status is the outcome of a call that did not succeed: the server's
// grpc-status and grpc-message, or what the client saw go wrong.
type Status struct {
	Code    Code
	Message string
}

// Error formats the status as grpc-go does.
func (s *Status) Error() string {
	return "rpc error: code = " + s.Code.String() + " desc = " + s.Message
}

// CodeOf returns err's code: OK for nil, Unknown for an error that is not
// a *Status.
func CodeOf(err error) Code {
	if err == nil {
		return OK
	}
	var s *Status
	if errors.As(err, &s) {
		return s.Code
	}
	return Unknown
}

// MessageOf returns err's status message (err's text when it is not a
// *Status); empty for nil.
func MessageOf(err error) string {
	if err == nil {
		return ""
	}
	var s *Status
	if errors.As(err, &s) {
		return s.Message
	}
	return err.Error()
}

// httpStatusCode maps a non-200 HTTP status to a code as gRPC's HTTP
// mapping does.
func httpStatusCode(status string) Code {
	switch status {
	case "400":
		return Internal
	case "401":
		return Unauthenticated
	case "403":
		return PermissionDenied
	case "404":
		return Unimplemented
	case "429", "502", "503", "504":
		return Unavailable
	}
	return Unknown
}

// resetStatus maps the error code of an RST_STREAM as grpc-go does.
func resetStatus(h2code uint32) *Status {
	code := Internal
	switch h2code {
	case 0x7: // REFUSED_STREAM
		code = Unavailable
	case 0x8: // CANCEL
		code = Canceled
	case 0xb: // ENHANCE_YOUR_CALM
		code = ResourceExhausted
	case 0xc: // INADEQUATE_SECURITY
		code = PermissionDenied
	}
	return &Status{Code: code, Message: "stream reset by the server, HTTP/2 error code " + strconv.FormatUint(uint64(h2code), 10)}
}
