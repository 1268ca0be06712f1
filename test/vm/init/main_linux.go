// Command init is the /init of the VM lane's initramfs: a static program that
// runs as PID 1 inside qemu. It mounts the pseudo file systems, loads kernel
// modules with finit_module, sets loopback up, runs one command (a `go test
// -c` binary) with the environment and arguments named in /etc/aether-vm.json
// and the KEY=VALUE words of the kernel command line, prints
// "TEST-EXIT <code>" on the console and restarts the machine, which qemu
// (started with -no-reboot) turns into its own exit.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ConfigPath is where the host puts the run's configuration.
const configPath = "/etc/aether-vm.json"

// config mirrors the JSON the host writes (test/vm.guestConfig).
type config struct {
	Modules []string `json:"modules"`
	Env     []string `json:"env"`
	Argv    []string `json:"argv"`
	Dir     string   `json:"dir"`
}

func logf(format string, args ...any) {
	_, _ = fmt.Fprintf(os.Stdout, "aether-init: "+format+"\n", args...)
}

func uptime() string {
	b, err := os.ReadFile("/proc/uptime")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "?"
	}
	return f[0] + "s"
}

func main() {
	code := run()
	// The marker starts on a fresh line so kernel messages cannot glue to it.
	_, _ = fmt.Fprintf(os.Stdout, "\nTEST-EXIT %d\n", code)
	// The console is a tty: what was written sits in the serial driver's
	// buffer until the (emulated, slow under TCG) UART sends it. Restarting
	// now could cut the marker off, so wait until the output has drained.
	if err := unix.IoctlSetInt(int(os.Stdout.Fd()), unix.TCSBRK, 1); err != nil {
		logf("failed to drain the console: %v", err)
		time.Sleep(2 * time.Second)
	}
	unix.Sync()
	// reboot=t on the kernel command line makes this a triple fault; qemu
	// runs with -no-reboot, so it exits.
	if err := unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART); err != nil {
		logf("reboot failed: %v", err)
	}
	for {
		time.Sleep(time.Hour)
	}
}

func mounts() error {
	for _, m := range []struct {
		src, dst, fstype string
		flags            uintptr
		data             string
	}{
		{"proc", "/proc", "proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
		{"sysfs", "/sys", "sysfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
		{"tmpfs", "/tmp", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
		{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755"},
	} {
		if err := os.MkdirAll(m.dst, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, m.dst, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("failed to mount %s on %s: %w", m.fstype, m.dst, err)
		}
	}
	// Network namespace files are bind-mounted under /run; the netns file
	// system needs no mount of its own.
	return os.MkdirAll("/run/netns", 0o755)
}

func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	for {
		err = unix.FinitModule(int(f.Fd()), "", 0)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
	return err
}

func loUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

func run() int {
	if err := mounts(); err != nil {
		logf("%v", err)
		return 120
	}
	logf("started at kernel uptime %s", uptime())
	raw, err := os.ReadFile(configPath)
	if err != nil {
		logf("failed to read %s: %v", configPath, err)
		return 121
	}
	var cfg config
	if err := json.Unmarshal(raw, &cfg); err != nil {
		logf("failed to parse %s: %v", configPath, err)
		return 121
	}
	for _, m := range cfg.Modules {
		if err := loadModule(m); err != nil {
			logf("failed to load module %s: %v", m, err)
			return 122
		}
	}
	logf("loaded %d modules", len(cfg.Modules))
	if err := loUp(); err != nil {
		logf("failed to set lo up: %v", err)
		return 123
	}
	if len(cfg.Argv) == 0 {
		logf("%s names no command", configPath)
		return 121
	}
	env := []string{"PATH=/bin:/sbin:/usr/bin", "HOME=/root", "TMPDIR=/tmp", "USER=root"}
	// The kernel hands unrecognised KEY=VALUE words of its command line to
	// init's environment; pass them on, then the configured ones.
	for _, kv := range os.Environ() {
		if k, _, ok := strings.Cut(kv, "="); ok && k != "HOME" && k != "TERM" && k != "PATH" {
			env = append(env, kv)
		}
	}
	env = append(env, cfg.Env...)
	cmd := exec.Command(cfg.Argv[0], cfg.Argv[1:]...)
	cmd.Env = env
	cmd.Dir = cfg.Dir
	if cmd.Dir == "" {
		cmd.Dir = "/"
	}
	cmd.Stdout = os.Stdout
	cmd.Stderr = os.Stdout
	logf("running %s at kernel uptime %s", strings.Join(cfg.Argv, " "), uptime())
	err = cmd.Run()
	logf("command ended at kernel uptime %s", uptime())
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			logf("command killed by %v", ws.Signal())
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	default:
		logf("failed to run %s: %v", cfg.Argv[0], err)
		return 124
	}
}
