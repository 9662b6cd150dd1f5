# Make targets for the kernel series; the top-level Makefile includes this file.
# They are slow (minutes) and stay out of `make test`; see README.md.
#
#   make kernel-check   install what is missing (setup.sh), apply the series
#                       to linux-source-6.12, checkpatch --strict, compile
#                       with CONFIG_BLK_IO_TAG on and off
#   make kernel-boot    the same, then build a small kernel and boot it under
#                       qemu with NVMe disks (tag checked at completion), and
#                       run the recorder's decoding on the guest's records
#
# The tree and build directories live in KERNEL_CHECK_WORK (default
# /var/cache/stall-recorder-kernel/check) and are reused between runs.

KERNEL_PATCHES_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))

.PHONY: kernel-check kernel-boot
kernel-check:
	@$(KERNEL_PATCHES_DIR)/setup.sh
	$(KERNEL_PATCHES_DIR)/check

kernel-boot: setup-test
	@$(KERNEL_PATCHES_DIR)/setup.sh --boot
	$(KERNEL_PATCHES_DIR)/check --boot
