package enivlan

import (
	"io"
	"log/slog"
	"os"
	"strings"
)

// Environment variables that steer the plugin's logs (a plugin never logs
// to stdout, which carries the result).
const (
	// LogFileEnv names a file the plugin appends its logs to (else stderr).
	LogFileEnv = "ENI_VLAN_LOG_FILE"
	// LogLevelEnv is debug, info, warn (default) or error.
	LogLevelEnv = "ENI_VLAN_LOG_LEVEL"
)

// NewLogger returns the plugin's logger per LogFileEnv and LogLevelEnv, and
// a function closing the log file.
func NewLogger() (*slog.Logger, func()) {
	var w io.Writer = os.Stderr
	closeFn := func() {}
	if p := os.Getenv(LogFileEnv); p != "" {
		if f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600); err == nil {
			w = f
			closeFn = func() { f.Close() }
		}
	}
	lvl := slog.LevelWarn
	switch strings.ToLower(os.Getenv(LogLevelEnv)) {
	case "debug":
		lvl = slog.LevelDebug
	case "info":
		lvl = slog.LevelInfo
	case "error":
		lvl = slog.LevelError
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: lvl, ReplaceAttr: utcTime})).With("plugin", "eni-vlan"), closeFn
}

// utcTime writes a record's time in UTC. A plugin process lives for one
// call, and a time in the local zone would have its first log line load the
// zone from /etc/localtime (about 0.1 ms; a surrogate-link build logs its
// warning on every call).
func utcTime(groups []string, a slog.Attr) slog.Attr {
	if len(groups) == 0 && a.Key == slog.TimeKey && a.Value.Kind() == slog.KindTime {
		a.Value = slog.TimeValue(a.Value.Time().UTC())
	}
	return a
}

// Log attribute keys.
const (
	keyContainer = "container_id"
	keyPod       = "pod"
	keyIfName    = "if_name"
	keyVLAN      = "vlan"
	keyMAC       = "mac"
	keyIP        = "ip"
	keyGateway   = "gateway"
	keyAttempts  = "attempts"
	keyRTT       = "rtt"
	keyFamily    = "family"
	keyErr       = "error"
	keyLink      = "link_kind"
	keyStep      = "step"
)
